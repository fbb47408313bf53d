"""Per-parameter tensors between a TP x PP layout and full (unsplit) tensors, by name.

Used alike for the model's weights and for every optimizer tensor laid out like them
(parameter_state.py), so both are merged and split by the same rule: a parameter's TP
slices are merged with its partition info ([tensor_parallel, dim, stride]); a name held by
several stages (the tied embedding's copy on the last stage) is taken from the first. Which stages hold
a name (`stages_of`) lives in core/models/gpt/canonical_layout.py, shared with the
exchange between sites of different TP x PP.
convert.py merges one parameter at a time and writes one target slot at a time
(`merge_plan`, `merge_slices`, `split_slot`), so no layout is ever held whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Dict, Iterable, List, Tuple

import torch

from megatron_lsgd.core.models.gpt.canonical_layout import stages_of
from megatron_lsgd.core.tensor_parallel.initialize import merge_tp_slices, take_tp_slice

Slot = Tuple[int, int]  # (tp_rank, pp_rank)


def merge_plan(names: Dict[Slot, Iterable[str]], tp: int, pp: int) -> Dict[str, List[Slot]]:
    """{(tp_rank, pp_rank): names held} -> {name: the slots its TP slices are taken from, in
    TP order}, names in the order first met (stages, then TP ranks)."""
    slices: Dict[str, Dict[int, Slot]] = {}
    owner: Dict[str, int] = {}  # the stage a name is taken from
    for p in range(pp):
        for t in range(tp):
            for name in names.get((t, p), ()):
                if owner.setdefault(name, p) != p:
                    continue  # the last stage's copy of the tied embedding: stage 0 holds it
                slices.setdefault(name, {})[t] = (t, p)
    return {name: [by_rank[t] for t in sorted(by_rank)] for name, by_rank in slices.items()}


def merge_slices(ordered: List[torch.Tensor], info: list) -> torch.Tensor:
    """A parameter's full tensor from its TP slices in TP order ([tensor_parallel, dim, stride])."""
    is_tp, dim, stride = info
    return merge_tp_slices(ordered, dim, stride) if is_tp and len(ordered) > 1 else ordered[0]


def split_slot(full: Mapping, partition: Dict[str, list], slot: Slot, tp: int, pp: int, num_layers: int,
               tied: bool) -> Dict[str, torch.Tensor]:
    """{name: full tensor} -> {name: local slice} of target `slot` (tp_rank, pp_rank): the
    names its stage holds, in `full`'s order, each a contiguous copy of its own (each full
    tensor is made, by a lazy mapping, only for the slots that need it)."""
    t, p = slot
    out: Dict[str, torch.Tensor] = {}
    for name in full:
        if p not in stages_of(name, num_layers, pp, tied):
            continue
        value = full[name]
        is_tp, dim, stride = partition[name]
        local = take_tp_slice(value, dim, stride, tp, t) if is_tp else value
        out[name] = local.clone().contiguous()
    return out
