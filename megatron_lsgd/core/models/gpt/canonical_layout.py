"""The GPT model's parameters in a form independent of TP x PP, one sync unit at a time.

A parameter's canonical form is its full (unsplit) tensor under its single-rank name, as a
checkpoint's full model holds it (training/checkpointing/full_model.py), flattened. A unit
(`embedding`, `layers.<i>`, `output`) is its parameters' canonical forms concatenated in
the single-rank model's order. The maps between a rank's local slices and this form are
the ones the checkpoint converter reshards with, kept here so that core code can use them
too: `take_tp_slice` (the TP dim and the interleaving stride of fused QKV / gated MLPs)
for tensor parallelism, `stages_of` for pipeline stages, `partition_info` and
`param_specs` for what a parameter is. Sites of different TP x PP exchange across sites
in this form (core/lsgd/canonical_exchange.py); the padded vocabulary is part of the
shape, so every site must pad it alike (training.py pads to every site's TP).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
from torch import nn

from megatron_lsgd.core.models.gpt.gpt_model import SHARED_EMBEDDING_NAME, GPTModel
from megatron_lsgd.core.parallel_state import ParallelDims, ProcessGroups, RankCoords
from megatron_lsgd.core.tensor_parallel.initialize import take_tp_slice
from megatron_lsgd.core.tensor_parallel.random import RNGStatesTracker
from megatron_lsgd.core.transformer.config import TransformerConfig


def partition_info(p: nn.Parameter) -> list:
    """[is_tensor_parallel, partition_dim, partition_stride]"""
    return [bool(getattr(p, "tensor_model_parallel", False)), int(getattr(p, "partition_dim", 0)),
            int(getattr(p, "partition_stride", 1))]


def single_rank_pgs() -> ProcessGroups:
    return ProcessGroups(dims=ParallelDims(), rank=0, coords=RankCoords(0, 0, 0, 0))


def param_specs(config: TransformerConfig) -> Dict[str, Tuple[Tuple[int, ...], list]]:
    """Single-rank name -> (full shape, [tensor_parallel, dim, stride]), in the single-rank
    model's order, from a model built on the meta device (no memory, no process groups)."""
    with torch.device("meta"):
        model = GPTModel(config, single_rank_pgs(), RNGStatesTracker(torch.device("cpu")))
    return {name: (tuple(p.shape), partition_info(p)) for name, p in model.global_named_parameters()}


def stages_of(name: str, num_layers: int, pp: int, tied: bool) -> List[int]:
    """The pipeline stages that hold parameter `name` (the first holds the copy that counts)."""
    if name.startswith("layers."):
        return [int(name.split(".")[1]) // (num_layers // pp)]
    if name.startswith("embedding."):
        stages = [0]
        if tied and pp > 1 and name == SHARED_EMBEDDING_NAME:
            stages.append(pp - 1)  # the last stage keeps its own copy of the tied output weight
        return stages
    return [pp - 1]  # final norm, output layer


def unit_of(name: str) -> str:
    """The sync unit (GPTModel.sync_units' names) a single-rank parameter name belongs to."""
    if name.startswith("layers."):
        return "layers." + name.split(".")[1]
    return "embedding" if name.startswith("embedding.") else "output"


@dataclass(frozen=True)
class CanonicalParam:
    name: str
    shape: Tuple[int, ...]
    info: list  # partition_info
    offset: int  # where its flattened full tensor starts in the unit

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def local_index(self, tp: int, tp_rank: int) -> torch.Tensor:
        """The canonical positions (in the unit) of a local slice's flattened values, in the
        slice's order: the converter's own TP split applied to the positions."""
        positions = torch.arange(self.offset, self.offset + self.numel, dtype=torch.int64).view(self.shape)
        is_tp, dim, stride = self.info
        if is_tp and tp > 1:
            positions = take_tp_slice(positions, dim, stride, tp, tp_rank)
        return positions.reshape(-1)


@dataclass(frozen=True)
class CanonicalUnit:
    name: str
    params: Tuple[CanonicalParam, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)


def canonical_units(config: TransformerConfig) -> List[CanonicalUnit]:
    """Every unit of the model, in the single-rank model's order, with its parameters."""
    by_unit: Dict[str, List[CanonicalParam]] = {}
    for name, (shape, info) in param_specs(config).items():
        params = by_unit.setdefault(unit_of(name), [])
        offset = params[-1].offset + params[-1].numel if params else 0
        params.append(CanonicalParam(name, shape, info, offset))
    return [CanonicalUnit(name, tuple(params)) for name, params in by_unit.items()]


def counts_here(param: CanonicalParam, config: TransformerConfig, tp_rank: int, pp_rank: int, pp: int) -> bool:
    """Whether this rank's copy of `param` is the one counted in the canonical form: each
    value once per model replica (a TP-replicated parameter on TP rank 0, the tied embedding
    on the first stage, not its copy on the last)."""
    tied = not config.untie_embeddings_and_output_weights
    if stages_of(param.name, config.num_layers, pp, tied)[0] != pp_rank:
        return False
    return bool(param.info[0]) or tp_rank == 0
