"""Per-parameter tensors between a TP x PP layout and full (unsplit) tensors, by name.

Used alike for the model's weights and for every optimizer tensor laid out like them
(parameter_state.py), so both are merged and split by the same rule: a parameter's TP
slices are merged with its partition info ([tensor_parallel, dim, stride]); a name held by
several stages (the tied embedding's copy on the last stage) is taken from the first.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from megatron_lsgd.core.models.gpt.gpt_model import SHARED_EMBEDDING_NAME
from megatron_lsgd.core.tensor_parallel.initialize import merge_tp_slices, take_tp_slice

Slot = Tuple[int, int]  # (tp_rank, pp_rank)


def merge_layout(pieces: Dict[Slot, Dict[str, torch.Tensor]], partition: Dict[str, list], tp: int, pp: int
                 ) -> Dict[str, torch.Tensor]:
    """{(tp_rank, pp_rank): {name: local slice}} -> {name: full tensor}."""
    slices: Dict[str, Dict[int, torch.Tensor]] = {}
    owner: Dict[str, int] = {}  # the stage a name is taken from
    for p in range(pp):
        for t in range(tp):
            for name, value in pieces.get((t, p), {}).items():
                if owner.setdefault(name, p) != p:
                    continue  # the last stage's copy of the tied embedding: stage 0 holds it
                slices.setdefault(name, {})[t] = value
    out = {}
    for name, by_rank in slices.items():
        is_tp, dim, stride = partition[name]
        ordered = [by_rank[t] for t in sorted(by_rank)]
        out[name] = merge_tp_slices(ordered, dim, stride) if is_tp and len(ordered) > 1 else ordered[0]
    return out


def stages_of(name: str, num_layers: int, pp: int, tied: bool) -> List[int]:
    """The pipeline stages that hold parameter `name`."""
    if name.startswith("layers."):
        return [int(name.split(".")[1]) // (num_layers // pp)]
    if name.startswith("embedding."):
        stages = [0]
        if tied and pp > 1 and name == SHARED_EMBEDDING_NAME:
            stages.append(pp - 1)  # the last stage keeps its own copy of the tied output weight
        return stages
    return [pp - 1]  # final norm, output layer


def split_layout(full: Dict[str, torch.Tensor], partition: Dict[str, list], tp: int, pp: int, num_layers: int,
                 tied: bool) -> Dict[Slot, Dict[str, torch.Tensor]]:
    """{name: full tensor} -> {(tp_rank, pp_rank): {name: local slice}} (contiguous copies)."""
    out: Dict[Slot, Dict[str, torch.Tensor]] = {(t, p): {} for t in range(tp) for p in range(pp)}
    for name, value in full.items():
        is_tp, dim, stride = partition[name]
        for t in range(tp):
            local = take_tp_slice(value, dim, stride, tp, t) if is_tp else value
            for p in stages_of(name, num_layers, pp, tied):
                out[(t, p)][name] = local.clone().contiguous()
    return out
