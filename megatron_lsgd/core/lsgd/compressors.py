"""Compressors: the mean across sites of one fragment's tensors, with error feedback.

Any synchronizer that sends gradients or pseudo-gradients takes one compressor per
fragment (`CompressorBank.for_views`), so error feedback is owned per fragment: the whole
model for sync/diloco/dilocox, one fragment for the streaming algorithms, one unit for
layer-wise ones. `--lsgd-compression` picks the kind:

    none          exact fp32 mean (ring all-reduce), no error feedback
    int8, int4    per-block absmax quantization (means.py), error feedback
    lowrank-int4  PowerSGD-style low rank, P and Q in int4, error feedback
    topk-2bit     SparseLoCo: chunked top-k, 2-bit values, all-gathered sparse (sparse.py)

Per round a lossy compressor sends C(M) with M = x + beta e and keeps e <- M - (what this
rank contributed, as every site reconstructs it). With beta = 1 (`--lsgd-ef-decay`, the
default) the sum over rounds of the contributions plus the final residual equals the sum
of the inputs (mass conservation, tested); beta < 1 (SparseLoCo's 0.95) lets old error
fade. A new kind subclasses `ErrorFeedbackCompressor` and implements `_compressed_mean`.
"""

from __future__ import annotations

import abc
import zlib
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from megatron_lsgd.core.lsgd.comm import InterSiteComm
from megatron_lsgd.core.lsgd.config import CompressionOptions
from megatron_lsgd.core.lsgd.means import (RequantizationFeedback, SideValues, fp32_mean, lowrank_mean,
                                           payload_bytes, quantized_mean)
from megatron_lsgd.core.lsgd.reduction import Reduction
from megatron_lsgd.core.lsgd.sparse import SparseLayout, sparse_mean, topk_per_chunk

Layout = List[List[Tuple[Tuple[int, ...], int, int, int, int]]]


# ---- which parts of a fragment's tensors are matrices -------------------------------------------
@dataclass
class Segment:
    shard: int  # index into main_param_shards()
    lo: int
    hi: int
    rows: int = 0  # > 0: a row-aligned piece of a 2-D weight, viewed (rows, cols)
    cols: int = 0

    @property
    def is_matrix(self) -> bool:
        return self.rows > 0


def split_segments(layout: List[List[Tuple[Tuple[int, ...], int, int, int, int]]], rank: int) -> List[Segment]:
    """layout[shard] = [(param shape, p_lo, p_hi, s_lo, s_hi)] (see ShardedOptimizer.shard_layout).

    A 2-D (or higher, flattened to (shape[0], rest)) weight's piece is compressed by rank
    when its whole rows form a matrix with rank * (rows + cols) < rows * cols; ragged
    edges under ZeRO-1, 1-D tensors and small matrices go to the remainder."""
    segs: List[Segment] = []
    for shard, pieces in enumerate(layout):
        for shape, p_lo, p_hi, s_lo, s_hi in pieces:
            if len(shape) >= 2 and rank > 0:
                cols = 1
                for d in shape[1:]:
                    cols *= d
                first = -(-p_lo // cols) * cols
                last = (p_hi // cols) * cols
                rows = (last - first) // cols
                if rows > 0 and rank * (rows + cols) < rows * cols:
                    if first > p_lo:
                        segs.append(Segment(shard, s_lo, s_lo + first - p_lo))
                    segs.append(Segment(shard, s_lo + first - p_lo, s_lo + last - p_lo, rows, cols))
                    if last < p_hi:
                        segs.append(Segment(shard, s_lo + last - p_lo, s_hi))
                    continue
            segs.append(Segment(shard, s_lo, s_hi))
    return segs


# ---- the compressors ----------------------------------------------------------------------------
class Compressor:
    """Exact fp32 mean (`none`): what every compressor computes, without compression."""

    kind = "none"
    bits: Optional[int] = None
    rank = max_rank = 0  # only low rank has one
    last_effective_ranks: List[int] = []

    def __init__(self, comm: InterSiteComm, shapes: List[torch.Size], device: torch.device):
        self.comm = comm
        self.shapes = [torch.Size(s) for s in shapes]
        self.device = device
        self.errors: List[torch.Tensor] = []
        self.last_error_norm = 0.0
        self.last_input_norm = 0.0

    @property
    def numel(self) -> int:
        return sum(int(s.numel()) for s in self.shapes)

    def reduce(self, tensors: List[torch.Tensor], side: Optional[SideValues] = None) -> Reduction:
        """Generator: returns the per-tensor means (identical on every site). `side`: a few
        fp32 values averaged exactly in the same collectives (means.SideValues)."""
        mean, _ = yield from fp32_mean(self.comm, torch.cat([t.reshape(-1) for t in tensors]), side)
        return list(mean.split([t.numel() for t in tensors]))

    def payload_bytes_per_round(self) -> int:
        """Payload bytes per site for the current settings (for rules that size H)."""
        return payload_bytes(self.numel, self.bits, 64)

    def state_dict(self) -> Dict:
        return {"errors": [e.clone() for e in self.errors], "qs": [], "rank": 0, "requant_residual": torch.empty(0)}

    def load_state_dict(self, state: Dict) -> None:
        for e, saved in zip(self.errors, state["errors"]):
            e.copy_(saved)


class ErrorFeedbackCompressor(Compressor, abc.ABC):
    """A lossy compressor with error feedback; subclasses implement `_compressed_mean`."""

    def __init__(self, comm: InterSiteComm, shapes: List[torch.Size], device: torch.device, block: int,
                 variant: str, bits: Optional[int], decay: float = 1.0):
        super().__init__(comm, shapes, device)
        self.block = block
        self.variant = variant
        self.bits = bits
        self.decay = decay
        self.errors = [torch.zeros(s, dtype=torch.float32, device=device) for s in self.shapes]
        # Sites of different sizes: w_s x S, this site's weight times the number of sites. Each
        # site sends C(k x M), so the sites' plain mean is the mean weighted by tokens; the
        # error feedback stays in M's units (what was sent, divided by k). 1: equal sites.
        self.contribution_scale = 1.0

    @abc.abstractmethod
    def _compressed_mean(self, ms: List[torch.Tensor], side: Optional[SideValues] = None) -> Reduction:
        """Generator returning (means, this rank's contributions), one tensor per input;
        `side` rides along uncompressed (means.SideValues)."""

    def reduce(self, tensors: List[torch.Tensor], side: Optional[SideValues] = None) -> Reduction:
        if self.decay == 1.0:
            ms = [d + e for d, e in zip(tensors, self.errors)]
        else:
            ms = [torch.add(d, e, alpha=self.decay) for d, e in zip(tensors, self.errors)]
        k = self.contribution_scale
        if k == 1.0:
            means, sents = yield from self._compressed_mean(ms, side)
        else:
            means, sents = yield from self._compressed_mean([m * k for m in ms], side)
            sents = [s / k for s in sents]
        err_sq = in_sq = 0.0
        for e, m, s in zip(self.errors, ms, sents):
            torch.sub(m, s, out=e)
            err_sq += float(e.pow(2).sum())
            in_sq += float(m.pow(2).sum())
        self.last_error_norm, self.last_input_norm = err_sq ** 0.5, in_sq ** 0.5
        return means

    def payload_bytes_per_round(self) -> int:
        return payload_bytes(self.numel, self.bits, self.block)


class QuantizedCompressor(ErrorFeedbackCompressor):
    """int8 / int4: one quantized mean of the whole fragment (blocks run across tensors)."""

    def __init__(self, comm, shapes, device, block: int, variant: str, bits: int, decay: float = 1.0):
        super().__init__(comm, shapes, device, block, variant, bits, decay)
        self.kind = f"int{bits}"
        # The all-to-all variant's chunk owner feeds its requantization error back too.
        self.requant_feedback = RequantizationFeedback()

    def _compressed_mean(self, ms, side=None):
        flat = torch.cat([m.reshape(-1) for m in ms])
        mean, sent = yield from quantized_mean(self.comm, flat, self.bits, self.block, self.variant,
                                               self.requant_feedback, side)
        return list(mean.split([m.numel() for m in ms])), list(sent.split([m.numel() for m in ms]))

    def state_dict(self) -> Dict:
        state = super().state_dict()
        residual = self.requant_feedback.residual
        state["requant_residual"] = residual.clone() if residual is not None else torch.empty(0)
        return state

    def load_state_dict(self, state: Dict) -> None:
        super().load_state_dict(state)
        residual = state.get("requant_residual", torch.empty(0))  # absent in checkpoints that predate it
        self.requant_feedback.residual = residual.to(self.device).clone() if residual.numel() else None


class LowRankCompressor(ErrorFeedbackCompressor):
    """lowrank-int4: per row-aligned matrix piece P = M Q, mean, orthonormalize, Q = M^T P_hat,
    mean; Q warm-started from the last mean Q and seeded identically on every site. 1-D
    tensors, ragged ZeRO-1 edges and matrices too small to gain go int4 with the Q phase.
    The rank may change between rounds (`set_rank`, DiLoCoX's adaptive rule)."""

    kind = "lowrank-int4"

    def __init__(self, comm, shapes, device, block: int, variant: str, layout: Layout, rank: int, seed: int,
                 energy: float, bits: Optional[int] = 4, decay: float = 1.0):
        super().__init__(comm, shapes, device, block, variant, bits, decay)
        self.max_rank = self.rank = rank
        self.energy = energy
        self.seed = seed
        self.segments = split_segments(layout, rank)
        self.matrix_segments = [s for s in self.segments if s.is_matrix]
        self.qs = [self._random_q(i, seg.cols, rank) for i, seg in enumerate(self.matrix_segments)]
        self.last_effective_ranks: List[int] = []

    def _random_q(self, index: int, cols: int, width: int, offset: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index * 7919 + offset)
        return torch.randn(cols, width, generator=g).to(self.device)

    def set_rank(self, rank: int) -> None:
        """Shrink (keep the leading columns) or grow (seeded fresh columns) the warm start."""
        for i, (q, seg) in enumerate(zip(self.qs, self.matrix_segments)):
            if rank > q.shape[1]:
                extra = self._random_q(i, seg.cols, rank - q.shape[1], offset=q.shape[1])
                self.qs[i] = torch.cat([q, extra], dim=1)
        self.rank = rank

    def payload_bytes_per_round(self) -> int:
        p = sum(seg.rows * self.rank for seg in self.matrix_segments)
        q = sum(seg.cols * self.rank for seg in self.matrix_segments)
        rest = self.numel - sum(seg.rows * seg.cols for seg in self.matrix_segments)
        return payload_bytes(p, self.bits, self.block) + payload_bytes(q + rest, self.bits, self.block)

    def _compressed_mean(self, ms, side=None):
        mats = [ms[s.shard][s.lo:s.hi].view(s.rows, s.cols) for s in self.matrix_segments]
        rest_segs = [s for s in self.segments if not s.is_matrix]
        rest = torch.cat([ms[s.shard][s.lo:s.hi] for s in rest_segs]) if rest_segs else ms[0].new_zeros(0)
        qs = [q[:, :self.rank] for q in self.qs]
        res = yield from lowrank_mean(self.comm, mats, qs, rest, self.bits, self.block, self.variant, self.energy,
                                      side)
        means = [torch.empty_like(m) for m in ms]
        sents = [torch.empty_like(m) for m in ms]
        for seg, mean_m, sent_m in zip(self.matrix_segments, res.mean, res.sent):
            means[seg.shard][seg.lo:seg.hi] = mean_m.reshape(-1)
            sents[seg.shard][seg.lo:seg.hi] = sent_m.reshape(-1)
        offset = 0
        for seg in rest_segs:
            n = seg.hi - seg.lo
            means[seg.shard][seg.lo:seg.hi] = res.rest_mean[offset:offset + n]
            sents[seg.shard][seg.lo:seg.hi] = res.rest_sent[offset:offset + n]
            offset += n
        for i, qm in enumerate(res.q_mean):
            self.qs[i][:, :self.rank] = qm
        self.last_effective_ranks = res.effective_ranks
        return means, sents

    def state_dict(self) -> Dict:
        state = super().state_dict()
        state.update(qs=[q.clone() for q in self.qs], rank=self.rank)
        return state

    def load_state_dict(self, state: Dict) -> None:
        super().load_state_dict(state)
        self.qs = [q.to(self.device).clone() for q in state["qs"]]
        self.rank = int(state["rank"])


class SparseCompressor(ErrorFeedbackCompressor):
    """topk-2bit (SparseLoCo): per chunk of the fragment's flat vector (chunks run across
    tensors, like quantization blocks) the k largest |values| in 2 bits with one scale;
    every site all-gathers the payloads and sums them (sparse.py)."""

    kind = "topk-2bit"

    def __init__(self, comm, shapes, device, chunk: int, density: float, decay: float = 1.0):
        super().__init__(comm, shapes, device, chunk, "allgather", 2, decay)
        self.k = topk_per_chunk(density, chunk)

    def _compressed_mean(self, ms, side=None):
        flat = torch.cat([m.reshape(-1) for m in ms])
        mean, sent = yield from sparse_mean(self.comm, flat, self.block, self.k, side)
        return list(mean.split([m.numel() for m in ms])), list(sent.split([m.numel() for m in ms]))

    def payload_bytes_per_round(self) -> int:
        return SparseLayout(self.numel, self.block, self.k).nbytes


def build_compressor(options: CompressionOptions, comm: InterSiteComm, shapes: List[torch.Size], layout: Layout,
                     seed: int, device: torch.device, energy: float = 0.9) -> Compressor:
    if options.kind == "none":
        return Compressor(comm, shapes, device)
    if options.kind in ("int8", "int4"):
        return QuantizedCompressor(comm, shapes, device, options.quant_block, options.quantized_mean,
                                   int(options.kind[3:]), options.ef_decay)
    if options.kind == "topk-2bit":
        return SparseCompressor(comm, shapes, device, options.topk_chunk, options.topk_density, options.ef_decay)
    return LowRankCompressor(comm, shapes, device, options.quant_block, options.quantized_mean, layout, options.rank,
                             seed, energy, decay=options.ef_decay)


def compression_error(compressors: Iterable[Optional[Compressor]]) -> Dict[str, float]:
    """The log's compression statistic, for every algorithm: the last round's residual norm
    and its ratio to the compressed input's norm, over the compressors that have run (several,
    e.g. one per fragment: norms combined as one vector's); {} before any has."""
    ran = [c for c in compressors if c is not None and c.last_input_norm > 0]
    if not ran:
        return {}
    if len(ran) == 1:
        err, inp = ran[0].last_error_norm, ran[0].last_input_norm
    else:
        err = sum(c.last_error_norm ** 2 for c in ran) ** 0.5
        inp = sum(c.last_input_norm ** 2 for c in ran) ** 0.5
    return {"comp err norm": err, "comp rel err": err / inp}


class CompressorBank:
    """One compressor (and so one error-feedback state) per fragment, created on first use.

    A fragment is identified by its `ShardViews.key`; the whole model is "all". Low-rank warm
    starts are seeded by the run seed and the fragment's key, identically on every site."""

    def __init__(self, options: CompressionOptions, comm: InterSiteComm, seed: int, energy: float = 0.9):
        self.options = options
        self.comm = comm
        self.seed = seed
        self.energy = energy
        self.compressors: Dict[str, Compressor] = {}

    def for_views(self, views, device: torch.device) -> Compressor:
        comp = self.compressors.get(views.key)
        if comp is None:
            seed = self.seed if views.whole else self.seed + zlib.crc32(views.key.encode()) % 1_000_003
            comp = build_compressor(self.options, self.comm, [torch.Size([r.numel]) for r in views.ranges],
                                    views.layout(), seed, device, self.energy)
            self.compressors[views.key] = comp
        return comp

    def state_dict(self) -> Dict:
        # The exact mean (`none`) keeps nothing between rounds; leaving it out keeps the state
        # free of its key, which names a rank's part of a fragment (a layout detail).
        return {key: comp.state_dict() for key, comp in sorted(self.compressors.items()) if comp.kind != "none"}

    def load_state_dict(self, state: Dict, views_by_key: Dict[str, object], device: torch.device) -> None:
        for key, saved in state.items():
            if key not in views_by_key:
                raise ValueError(f"compressor state for fragment {key!r}, which this run does not have")
            self.for_views(views_by_key[key], device).load_state_dict(saved)
