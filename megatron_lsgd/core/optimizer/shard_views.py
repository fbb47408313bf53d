"""The unit <-> shard bridge: which parts of this rank's fp32 main shard belong to a set of
sync units.

Under ZeRO-1 the authoritative copy of a parameter is a slice of one rank's fp32 main
shard, so "the embedding" or "layer 3" is, on this rank, a few contiguous ranges of a few
main shards (possibly none). `ShardViews` holds those ranges as views of the main and grad
shards (writing into a view writes the optimizer's state), the parameter pieces inside
them (global names, shapes, flattened coordinates) and, for the intra-site all-gather,
where the units lie in each bucket independently of the rank.

A set that covers every unit of this rank is the whole main shard (padding included),
exactly the tensors `main_param_shards()` returns, so an algorithm that treats the whole
model as one fragment runs the same arithmetic on the same tensors as one that never
heard of units.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch


@dataclass(frozen=True)
class ShardRange:
    shard: int  # index into main_param_shards()
    lo: int
    hi: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class PieceView:
    """The part of one parameter that lies in one of the view's ranges."""

    name: str  # single-rank (global) parameter name
    shape: Tuple[int, ...]
    p_lo: int  # flattened parameter coordinates held here
    p_hi: int
    range_index: int  # which range of the ShardViews
    lo: int  # position inside that range
    hi: int


@dataclass(frozen=True)
class BucketExtent:
    """Where the units lie in one bucket, in bucket coordinates, on every rank of the site."""

    bucket: int  # index into main_param_shards() (one main shard per bucket)
    lo: int
    hi: int


class ShardViews:
    """This rank's share of a set of sync units (see the module docstring)."""

    def __init__(self, key: str, units: Tuple[str, ...], ranges: List[ShardRange], pieces: List[PieceView],
                 main: List[torch.Tensor], grad: List[torch.Tensor], extents: List[BucketExtent], whole: bool,
                 fragment: Optional[str] = None):
        self.key = key
        # The fragment these views are (a part of): the same key on every rank and in every
        # layout, for bookkeeping that must survive a change of DP_intra (outer step counts).
        self.fragment = key if fragment is None else fragment
        self.units = units
        self.ranges = ranges
        self.pieces = pieces
        self.main = main  # views of the fp32 main shards, one per range
        self.grad = grad  # views of the grad shards, one per range
        self.extents = extents
        self.whole = whole  # every unit of this rank: ranges are the full main shards

    @property
    def numel(self) -> int:
        return sum(r.numel for r in self.ranges)

    @property
    def empty(self) -> bool:
        return not self.ranges

    @property
    def names(self) -> List[str]:
        return sorted({p.name for p in self.pieces})

    def layout(self) -> List[List[Tuple[Tuple[int, ...], int, int, int, int]]]:
        """Per range: (param shape, p_lo, p_hi, lo, hi) of every piece in it (the format the
        compressors take to find matrices)."""
        out: List[List[tuple]] = [[] for _ in self.ranges]
        for p in self.pieces:
            out[p.range_index].append((p.shape, p.p_lo, p.p_hi, p.lo, p.hi))
        return out

    def part(self, index: int, parts: int) -> "ShardViews":
        """The index-th of `parts` near-equal consecutive pieces of every range (ceil-sized, the
        last ones possibly shorter or empty), with their param pieces clipped: how ranks that
        all hold the same ranges split the work on them (e.g. a site's replicas without
        ZeRO-1, each sending only its part across sites)."""
        spans = []
        for r in self.ranges:
            chunk = -(-r.numel // parts)
            spans.append((min(r.numel, index * chunk), min(r.numel, (index + 1) * chunk)))
        return self._cut(spans, f"{self.key}/part{index}of{parts}")

    def clip(self, bounds: Sequence[Tuple[int, int]], index: int, parts: int,
             key: Optional[str] = None) -> "ShardViews":
        """What of every range lies inside bounds[its range] (shard coordinates), as the index-th
        of `parts` (its key is `part`'s, unless `key`): a site's replicas without ZeRO-1
        splitting a set of units at the same places in every bucket, or a rank's part cut
        into lanes (sites of different sizes)."""
        spans = [(min(max(lo, r.lo), r.hi) - r.lo, max(min(hi, r.hi), r.lo) - r.lo)
                 for r, (lo, hi) in zip(self.ranges, bounds)]
        return self._cut(spans, key or f"{self.key}/part{index}of{parts}")

    def _cut(self, spans: Sequence[Tuple[int, int]], key: str) -> "ShardViews":
        """spans[j] = (lo, hi) inside range j: those pieces of the ranges (empty ones dropped),
        with their param pieces clipped."""
        ranges, main, grad, pieces, starts = [], [], [], [], {}
        for j, (r, (lo, hi)) in enumerate(zip(self.ranges, spans)):
            if hi > lo:
                starts[j] = (len(ranges), lo, hi)
                ranges.append(ShardRange(r.shard, r.lo + lo, r.lo + hi))
                main.append(self.main[j][lo:hi])
                grad.append(self.grad[j][lo:hi])
        for p in self.pieces:
            if p.range_index not in starts:
                continue
            k, lo, hi = starts[p.range_index]
            a, b = max(p.lo, lo), min(p.hi, hi)
            if a < b:
                pieces.append(PieceView(p.name, p.shape, p.p_lo + a - p.lo, p.p_lo + b - p.lo, k, a - lo, b - lo))
        return ShardViews(key, self.units, ranges, pieces, main, grad, [], False, fragment=self.fragment)

    def select(self, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """The ranges of per-shard tensors shaped like the main shards (anchors, momenta)."""
        return [tensors[r.shard][r.lo:r.hi] for r in self.ranges]

    def __repr__(self) -> str:
        return f"ShardViews({self.key!r}, {len(self.ranges)} ranges, {self.numel} values)"


def _merge(spans: Iterable[Tuple[int, int]]) -> List[Tuple[int, int]]:
    out: List[List[int]] = []
    for lo, hi in sorted(spans):
        if out and out[-1][1] == lo:
            out[-1][1] = hi
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def build_views(key: str, unit_names: Tuple[str, ...], param_ids: set, main_shards, buffers, shard_index: int,
                names: Dict[int, str], whole: bool) -> ShardViews:
    """`main_shards`: the optimizer's [(bucket, main, grad)]; `buffers[i]`: the
    ParamAndGradBuffer that owns main shard i's bucket."""
    ranges: List[ShardRange] = []
    pieces: List[PieceView] = []
    extents: List[BucketExtent] = []
    for i, (bucket, main, _grad) in enumerate(main_shards):
        buffer = buffers[i]
        if whole:
            spans = [(0, main.numel())]
            ext = [(0, bucket.numel)]
        else:
            own = [(s_lo, s_hi) for p, _, _, s_lo, s_hi in buffer.shard_pieces(bucket, shard_index)
                   if id(p) in param_ids]
            spans = _merge(own)
            ext = _merge((buffer.param_offsets[id(p)][0] - bucket.start, buffer.param_offsets[id(p)][1] - bucket.start)
                         for p in bucket.params if id(p) in param_ids)
        extents += [BucketExtent(i, lo, hi) for lo, hi in ext]
        first = len(ranges)
        ranges += [ShardRange(i, lo, hi) for lo, hi in spans]
        for p, p_lo, p_hi, s_lo, s_hi in buffer.shard_pieces(bucket, shard_index):
            if not whole and id(p) not in param_ids:
                continue
            for j in range(first, len(ranges)):
                r = ranges[j]
                if r.lo <= s_lo and s_hi <= r.hi:
                    pieces.append(PieceView(names.get(id(p), f"<param {id(p)}>"), tuple(p.shape), p_lo, p_hi, j,
                                            s_lo - r.lo, s_hi - r.lo))
                    break
    main = [main_shards[r.shard][1][r.lo:r.hi] for r in ranges]
    grad = [main_shards[r.shard][2][r.lo:r.hi] for r in ranges]
    return ShardViews(key, unit_names, ranges, pieces, main, grad, extents, whole)


def sum_of_squares(tensors: Sequence[torch.Tensor], spans: Iterable[Tuple[int, int, int]]) -> float:
    """The sum of squares of tensors[range][lo:hi] over `spans` (an optimizer's `counted_spans`
    of the views the tensors are laid out like), accumulated in float64. The norms are read
    back to the host once for all spans (one device sync, not one per span); squaring and
    summing them there keeps the arithmetic of the per-span version bit for bit."""
    norms = [torch.linalg.vector_norm(tensors[r][lo:hi], dtype=torch.float64) for r, lo, hi in spans]
    total = 0.0
    for norm in torch.stack(norms).tolist() if norms else []:
        total += norm ** 2
    return total
