"""Layout-independent parameter initialization.

Every parameter's full (unpartitioned) value is drawn from a generator seeded by the run
seed and the parameter's *global* name, then the local slice is taken according to the
partition metadata set by the layers. TP=4 x PP=2 therefore starts from exactly the
weights a single rank would have, which is what the equivalence tests rely on.
"""

from __future__ import annotations

import zlib
from typing import Iterable, Tuple

import torch
from torch import nn


def full_shape(param: nn.Parameter, tp_size: int) -> Tuple[int, ...]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp_size
    return tuple(shape)


def take_tp_slice(full: torch.Tensor, dim: int, stride: int, tp_size: int, tp_rank: int) -> torch.Tensor:
    """Rank's slice: split into `stride` interleaved blocks (e.g. SwiGLU's [gate; up]),
    each block split across ranks, this rank's pieces concatenated."""
    blocks = full.chunk(stride, dim=dim)
    return torch.cat([b.chunk(tp_size, dim=dim)[tp_rank] for b in blocks], dim=dim)


def merge_tp_slices(slices, dim: int, stride: int) -> torch.Tensor:
    """Inverse of take_tp_slice over all ranks' slices (for checkpoint conversion)."""
    per_rank_blocks = [s.chunk(stride, dim=dim) for s in slices]
    return torch.cat([torch.cat([blocks[i] for blocks in per_rank_blocks], dim=dim) for i in range(stride)], dim=dim)


def master_value(name: str, shape, kind: str, std: float, seed: int) -> torch.Tensor:
    if kind == "zeros":
        return torch.zeros(shape)
    if kind == "ones":
        return torch.ones(shape)
    if kind != "normal":
        raise ValueError(f"unknown init kind {kind!r} for {name}")
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return torch.empty(shape).normal_(0.0, std, generator=gen)


@torch.no_grad()
def initialize_parameters(named_params: Iterable[Tuple[str, nn.Parameter]], seed: int,
                          tp_size: int, tp_rank: int) -> None:
    for name, p in named_params:
        full = master_value(name, full_shape(p, tp_size), p.init_kind, p.init_std, seed)
        if getattr(p, "tensor_model_parallel", False):
            full = take_tp_slice(full, p.partition_dim, p.partition_stride, tp_size, tp_rank)
        p.copy_(full.to(dtype=p.dtype, device=p.device))
