"""Tensor-parallel layers: column/row parallel linear and vocab-parallel embedding.

Layers allocate only their local slice and record on each parameter how it is
partitioned (`set_partition`). Values are filled afterwards by
`megatron_lsgd.core.tensor_parallel.initialize`, which builds the full tensor from a seed
keyed by the parameter's global name and slices it, so every layout starts from the
same weights as a single rank.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_lsgd.core.tensor_parallel import mappings


def set_partition(param: nn.Parameter, *, tensor_parallel: bool, dim: int = 0, stride: int = 1,
                  init: str = "normal", std: float = 0.02) -> nn.Parameter:
    """Annotate a parameter: `tensor_parallel` params are sliced along `dim` (in `stride`
    interleaved chunks); others are replicated across TP ranks."""
    param.tensor_model_parallel = tensor_parallel
    param.partition_dim = dim
    param.partition_stride = stride
    param.init_kind = init
    param.init_std = std
    return param


def _tp_size_rank(group):
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({d})")
    return n // d


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split by columns (output features) across TP ranks."""

    def __init__(self, input_size: int, output_size: int, *, tp_group, bias: bool = True,
                 gather_output: bool = False, init_std: float = 0.02, stride: int = 1,
                 sequence_parallel: bool = False, skip_weight_param: bool = False,
                 params_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.tp_group = tp_group
        tp, _ = _tp_size_rank(tp_group)
        self.output_size_per_partition = _divide(output_size, tp, "output size")
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel and tp > 1
        if skip_weight_param:  # the weight is passed to forward (tied output layer)
            self.weight = None
        else:
            self.weight = set_partition(nn.Parameter(torch.empty(
                self.output_size_per_partition, input_size, dtype=params_dtype, device=device)),
                tensor_parallel=True, dim=0, stride=stride, std=init_std)
        if bias:
            self.bias = set_partition(nn.Parameter(torch.empty(
                self.output_size_per_partition, dtype=params_dtype, device=device)),
                tensor_parallel=True, dim=0, stride=stride, init="zeros")
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        weight = self.weight if weight is None else weight
        if self.sequence_parallel:
            x = mappings.gather_from_sequence_parallel_region(x, self.tp_group)
        else:
            x = mappings.copy_to_tensor_parallel_region(x, self.tp_group)
        y = F.linear(x, weight, self.bias)
        if self.gather_output:
            y = mappings.gather_from_tensor_parallel_region(y, self.tp_group)
        return y


class RowParallelLinear(nn.Module):
    """Y = X A + b with A split by rows (input features); the input arrives split on its
    last dim and partial outputs are summed (or reduce-scattered under sequence parallel)."""

    def __init__(self, input_size: int, output_size: int, *, tp_group, bias: bool = True,
                 input_is_parallel: bool = True, init_std: float = 0.02, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.tp_group = tp_group
        tp, _ = _tp_size_rank(tp_group)
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel and tp > 1
        self.weight = set_partition(nn.Parameter(torch.empty(
            output_size, _divide(input_size, tp, "input size"), dtype=params_dtype, device=device)),
            tensor_parallel=True, dim=1, std=init_std)
        if bias:
            # Replicated on every TP rank and added after the reduction. Under sequence
            # parallel each rank sees part of the sequence, so its grad needs a TP all-reduce.
            self.bias = set_partition(nn.Parameter(torch.empty(output_size, dtype=params_dtype, device=device)),
                                      tensor_parallel=False, init="zeros")
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = mappings.scatter_to_tensor_parallel_region(x, self.tp_group)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = mappings.reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
        else:
            y = mappings.reduce_from_tensor_parallel_region(y, self.tp_group)
        if self.bias is not None:
            y = y + self.bias
        return y


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; each rank looks up the ids it owns and the
    partial results are summed across TP ranks."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group, init_std: float = 0.02,
                 params_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.tp_group = tp_group
        tp, rank = _tp_size_rank(tp_group)
        per_rank = _divide(num_embeddings, tp, "padded vocabulary size")
        self.vocab_start = rank * per_rank
        self.vocab_end = self.vocab_start + per_rank
        self.weight = set_partition(nn.Parameter(torch.empty(
            per_rank, embedding_dim, dtype=params_dtype, device=device)), tensor_parallel=True, dim=0, std=init_std)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group is None or dist.get_world_size(self.tp_group) == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return mappings.reduce_from_tensor_parallel_region(out, self.tp_group)
