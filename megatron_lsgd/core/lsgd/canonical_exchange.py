"""The mean across sites of different TP x PP, in the model's layout-free form.

Sites of different tensor x pipeline layouts (--site-tensor/pipeline-model-parallel-sizes)
hold the same model cut differently, so no rank of one site holds the range of values a
rank of another holds. What crosses sites (diloco's pseudo-gradient, the warm-up's
gradients) is therefore exchanged in the canonical form of core/models/gpt/canonical_layout.py,
one sync unit at a time:

1. every rank writes the values it holds of the unit (its ZeRO-1 shard, or its part of the
   replica: each value of the model once per site, `counts_here`) at their canonical
   positions into a zeroed buffer of the unit's padded size;
2. a reduce-scatter over the site leaves each of its R_s ranks one contiguous chunk. Every
   other rank wrote a zero there, so the sum is the value, exactly;
3. the chunk is cut into lanes: L = lcm of the sites' rank counts, lane j is the j-th L-th
   of the unit, held on site s by its rank j // (L / R_s) (parallel_state's dp_inter lanes),
   so the two ends of every cross-site group hold the same canonical range; the comm
   averages each lane on its group;
4. an all-gather over the site gives every rank the unit's mean, from which it reads back
   the values it holds (every copy: a TP-replicated parameter, the tied embedding's copy).

Every site thus computes, for every value, the mean of the same per-site values in the
same order of sites, once, and all ranks read that one result: the sites receive
bit-identical means whatever their layouts. Cost per unit: a buffer of the unit's size on
every rank of the site (fp32, the largest unit bounds it: the embedding or output layer),
and intra-site traffic of about twice the unit per rank (reduce-scatter and all-gather
over the whole site, since stages not holding a unit take part with zeros); the
cross-site bytes are those of the model once per site, spread over its ranks by lanes.
Once per run: the int64 canonical positions of every parameter the rank holds (its TP part,
whole even under ZeRO-1), kept on the run's device; they depend only on the layout, so each
is made at its parameter's first exchange and no round rebuilds it.

The steps are split so that a mean may overlap inner steps (dilocox's round-late mean,
streaming's fragments): `issue` runs steps 1-2 at once, on the calling (compute) thread, and
returns the inter-site part (step 3) as a reduction (reduction.py: one collective per
phase, advanced between steps); `land` runs step 4 where the mean is applied. Steps 2 and 4
are collectives over the whole site, so they run where every rank of the site is at the
same point of its program (a step boundary), never from a poll, whose timing differs. An
exchange of several units (a fragment, the whole model) sends, per lane, the lane's slice
of every unit in one collective. Such exchanges run on lanes of their own
(`use_dedicated_lanes`), since the other sites may be a step ahead or behind.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from megatron_lsgd.core.distributed.collectives import all_gather_flat, reduce_scatter_flat
from megatron_lsgd.core.lsgd.reduction import Reduction, run_blocking
from megatron_lsgd.core.models.gpt.canonical_layout import (CanonicalParam, CanonicalUnit, canonical_units,
                                                            counts_here, unit_of)
from megatron_lsgd.core.transformer.config import TransformerConfig


class CanonicalExchange:
    """A rank's side of the exchange (module docstring), for one model config and layout."""

    def __init__(self, pgs, config: TransformerConfig, device: torch.device):
        dims = pgs.dims
        self.pgs, self.config, self.device = pgs, config, device
        self.units = canonical_units(config)
        self.params: Dict[str, CanonicalParam] = {p.name: p for u in self.units for p in u.params}
        site = pgs.site_rank
        self.site_ranks = dims.ranks_of_site(site)
        self.lanes = dims.lanes  # L, every site's
        self.my_lanes = list(pgs.inter_lanes)  # [(lane, dp_inter group)], L / R_s consecutive ones
        # parameter -> canonical positions of its values on this rank: made at its first
        # exchange and kept, since they depend only on the layout, fixed for the run
        self._index: Dict[str, torch.Tensor] = {}

    def on_lanes(self, groups: Sequence) -> None:
        """Run the lanes' means on `groups` instead: fresh clones of this rank's lane groups, in
        the same order (comm.use_dedicated_group)."""
        if len(groups) != len(self.my_lanes):
            raise RuntimeError(f"{len(groups)} dedicated groups for this rank's {len(self.my_lanes)} lanes")
        self.my_lanes = [(lane, group) for (lane, _), group in zip(self.my_lanes, groups)]

    def _units(self, names: Optional[Sequence[str]]) -> List[CanonicalUnit]:
        """The units named (None: every unit), in the model's order, the same on every rank."""
        return self.units if names is None else [u for u in self.units if u.name in set(names)]

    def _width(self, unit: CanonicalUnit) -> int:
        return -(-unit.numel // self.lanes)

    def _positions(self, views, unit: str):
        """[(piece, canonical positions of its values, whether they count here)] of `views`' pieces in `unit`."""
        pgs, out = self.pgs, []
        for piece in views.pieces:
            if unit_of(piece.name) != unit:
                continue
            param = self.params[piece.name]
            counts = counts_here(param, self.config, pgs.tp_rank, pgs.pp_rank, pgs.dims.pp)
            out.append((piece, self._index_of(param)[piece.p_lo:piece.p_hi], counts))
        return out

    def _index_of(self, param: CanonicalParam) -> torch.Tensor:
        if param.name not in self._index:
            self._index[param.name] = param.local_index(self.pgs.dims.tp, self.pgs.tp_rank).to(self.device)
        return self._index[param.name]

    @torch.no_grad()
    def mean(self, comm, views, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        """The mean across sites of `tensors` (one per range of `views`, laid out like it;
        weighted as the comm weighs sites), in tensors laid out the same way. Blocking, one
        unit at a time (a buffer of one unit at a time)."""
        out = [torch.zeros_like(t) for t in tensors]  # padding: a zero mean, as a zero difference has
        for unit in self.units:  # every rank of every site, in the same order
            lanes = run_blocking(self.issue(comm, views, tensors, [unit.name]))
            self._land_into(out, views, lanes, [unit])
        return out

    @torch.no_grad()
    def issue(self, comm, views, tensors: List[torch.Tensor], units: Optional[Sequence[str]] = None,
              side=None) -> Reduction:
        """Steps 1-2 now (a collective over the site), for the units named (None: all; every
        rank of every site names the same); returns step 3, the lanes' means, as a reduction
        whose result is this rank's lanes (`land` reads them back). `side` (means.SideValues)
        rides in every lane and is averaged with it."""
        per_unit = []  # [this rank's lanes of the unit]
        for unit in self._units(units):
            width = self._width(unit)
            buf = torch.zeros(width * self.lanes, dtype=torch.float32, device=self.device)
            for piece, positions, counts in self._positions(views, unit.name):
                if counts:
                    buf[positions] = tensors[piece.range_index][piece.lo:piece.hi].to(self.device, torch.float32)
            chunk = self._scatter(buf)
            per_unit.append([chunk[k * width:(k + 1) * width] for k in range(len(self.my_lanes))])
        # lane k: its slice of every unit, in one collective
        lanes = [torch.cat([slices[k] for slices in per_unit]) if per_unit else torch.zeros(0, device=self.device)
                 for k in range(len(self.my_lanes))]
        return self._lane_means(comm, lanes, side)

    def _lane_means(self, comm, lanes: List[torch.Tensor], side) -> Reduction:
        n = lanes[0].numel() if lanes else 0
        sent = [torch.cat([lane, side.values.to(lane.device)]) if side is not None else lane for lane in lanes]
        handles = []
        for send, (_, group) in zip(sent, self.my_lanes):  # issued together: the lanes are different groups
            with comm.on_group(group):
                handles.append(comm.all_reduce_mean(send, async_op=True))
        for handle in handles:
            yield handle
        if side is not None:  # the same on every lane (a site's ranks send the same values)
            side.mean = sent[0][n:].clone()
        return [s[:n] for s in sent]

    @torch.no_grad()
    def land(self, views, lanes: List[torch.Tensor], units: Optional[Sequence[str]] = None) -> List[torch.Tensor]:
        """Step 4: the mean of `issue`'s units, from this rank's lanes (its result), in tensors
        laid out like `views`' ranges (a collective over the site: every rank calls it at the
        same point)."""
        out = [torch.zeros(m.shape, dtype=torch.float32, device=self.device) for m in views.main]
        self._land_into(out, views, lanes, self._units(units))
        return out

    def _land_into(self, out: List[torch.Tensor], views, lanes: List[torch.Tensor],
                   units: List[CanonicalUnit]) -> None:
        offset = 0
        for unit in units:
            width = self._width(unit)
            chunk = torch.cat([lane[offset:offset + width] for lane in lanes])
            offset += width
            buf = torch.empty(width * self.lanes, dtype=torch.float32, device=self.device)
            self._gather(buf, chunk)
            for piece, positions, _ in self._positions(views, unit.name):
                dest = out[piece.range_index][piece.lo:piece.hi]
                dest.copy_(buf[positions].to(dest.device, dest.dtype))

    def _scatter(self, buf: torch.Tensor) -> torch.Tensor:
        if self.site_ranks == 1:
            return buf
        chunk = torch.empty(buf.numel() // self.site_ranks, dtype=buf.dtype, device=buf.device)
        reduce_scatter_flat(chunk, buf, group=self.pgs.site)  # one writer per value: the sum is exact
        return chunk

    def _gather(self, buf: torch.Tensor, chunk: torch.Tensor) -> None:
        if self.site_ranks > 1:
            all_gather_flat(buf, chunk, group=self.pgs.site)
        else:
            buf.copy_(chunk)


def exchange_for(ctx) -> Optional[CanonicalExchange]:
    """The run's exchange when its sites' layouts differ (None otherwise)."""
    if not ctx.pgs.dims.mixed_layouts or ctx.comm.num_sites == 1:
        return None
    return CanonicalExchange(ctx.pgs, ctx.models[0].module.config, ctx.device)


def use_dedicated_lanes(ctx, exchange: Optional[CanonicalExchange], split=None) -> None:
    """For reductions that advance between inner steps: the comm, and the exchange's lanes when
    layouts differ (or `split`'s, site_split.SiteSplit, when sizes differ), move to dp_inter
    groups of their own (collective: every rank calls it), so nothing else issued on the shared
    groups (the loop's means) is matched out of order."""
    groups = ctx.comm.use_dedicated_group(ctx.pgs.dims)
    if exchange is not None:
        exchange.on_lanes(groups)
    if split is not None:
        split.on_lanes(groups)
