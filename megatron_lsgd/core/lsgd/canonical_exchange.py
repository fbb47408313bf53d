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
a parameter's int64 canonical positions while it is placed (made each round, not kept),
and intra-site traffic of about twice the unit per rank (reduce-scatter and all-gather
over the whole site, since stages not holding a unit take part with zeros); the
cross-site bytes are those of the model once per site, spread over its ranks by lanes.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from megatron_lsgd.core.distributed.collectives import all_gather_flat, reduce_scatter_flat
from megatron_lsgd.core.models.gpt.canonical_layout import CanonicalParam, canonical_units, counts_here, unit_of
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

    def _positions(self, views, unit: str):
        """[(piece, canonical positions of its values, whether they count here)] of `views`' pieces in `unit`."""
        pgs, out, index = self.pgs, [], {}
        for piece in views.pieces:
            if unit_of(piece.name) != unit:
                continue
            param = self.params[piece.name]
            if piece.name not in index:
                index[piece.name] = param.local_index(pgs.dims.tp, pgs.tp_rank).to(self.device)
            counts = counts_here(param, self.config, pgs.tp_rank, pgs.pp_rank, pgs.dims.pp)
            out.append((piece, index[piece.name][piece.p_lo:piece.p_hi], counts))
        return out

    @torch.no_grad()
    def mean(self, comm, views, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        """The mean across sites of `tensors` (one per range of `views`, laid out like it;
        weighted as the comm weighs sites), in tensors laid out the same way."""
        out = [torch.zeros_like(t) for t in tensors]  # padding: a zero mean, as a zero difference has
        for unit in self.units:  # every rank of every site, in the same order
            width = -(-unit.numel // self.lanes)
            buf = torch.zeros(width * self.lanes, dtype=torch.float32, device=self.device)
            placed = self._positions(views, unit.name)
            for piece, positions, counts in placed:
                if counts:
                    buf[positions] = tensors[piece.range_index][piece.lo:piece.hi].to(self.device, torch.float32)
            chunk = self._scatter(buf)
            for k, (_, group) in enumerate(self.my_lanes):
                with comm.on_group(group):
                    comm.all_reduce_mean(chunk[k * width:(k + 1) * width])
            self._gather(buf, chunk)
            for piece, positions, _ in placed:
                dest = out[piece.range_index][piece.lo:piece.hi]
                dest.copy_(buf[positions].to(dest.device, dest.dtype))
        return out

    def _scatter(self, buf: torch.Tensor) -> torch.Tensor:
        if self.site_ranks == 1:
            return buf
        chunk = torch.empty(buf.numel() // self.site_ranks, dtype=buf.dtype, device=buf.device)
        reduce_scatter_flat(chunk, buf, group=self.pgs.site)  # one writer per value: the sum is exact
        return chunk

    def _gather(self, buf: torch.Tensor, chunk: torch.Tensor) -> None:
        if self.site_ranks > 1:
            all_gather_flat(buf, chunk, group=self.pgs.site)


def exchange_for(ctx) -> Optional[CanonicalExchange]:
    """The run's exchange when its sites' layouts differ (None otherwise)."""
    if not ctx.pgs.dims.mixed_layouts or ctx.comm.num_sites == 1:
        return None
    return CanonicalExchange(ctx.pgs, ctx.models[0].module.config, ctx.device)

