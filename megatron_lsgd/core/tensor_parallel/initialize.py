"""Layout-independent parameter initialization.

Every parameter's full (unpartitioned) value is drawn from a generator seeded by the run
seed and the parameter's *global* name, then the local slice is taken according to the
partition metadata set by the layers. TP=4 x PP=2 therefore starts from exactly the
weights a single rank would have, which is what the equivalence tests rely on.

Two ways to get there, with the same values bit for bit:
- the exact path (a CPU run, and the regression fixtures): each parameter's full value is
  drawn on the host at once, the rank's slice copied;
- per shard (a GPU run, `max_host_elements`): the model is built on the meta device,
  `materialize_parameters` gives its parameters storage on the run's device, and each
  value is drawn on the host in pieces of whole rows of at most `max_host_elements`
  values, of which only this rank's slice is copied to the device. The draws come from the
  same CPU generator in the same order; the pieces are aligned on 16 values (the CPU
  normal_ transforms uniforms in blocks of 16 from the tensor's start and redraws the last
  16 when the size is not a multiple), so they give the values of one draw
  (`tests/unit_tests/core/test_init_per_shard.py` checks it, including on a meta-built model).
  The host never holds more than one piece.
"""

from __future__ import annotations

import math
import zlib
from typing import Iterable, List, Optional, Tuple

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


def _generator(name: str, seed: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))


def master_value(name: str, shape, kind: str, std: float, seed: int) -> torch.Tensor:
    if kind == "zeros":
        return torch.zeros(shape)
    if kind == "ones":
        return torch.ones(shape)
    if kind != "normal":
        raise ValueError(f"unknown init kind {kind!r} for {name}")
    return torch.empty(shape).normal_(0.0, std, generator=_generator(name, seed))


# A piece of a parameter drawn on the host at a time by the per-shard path (16 MiB of fp32).
MAX_HOST_ELEMENTS = 1 << 22


def row_pieces(rows: int, row_size: int, max_elements: int) -> List[Tuple[int, int]]:
    """Row ranges covering [0, rows), each a whole number of rows and, but for the last, a
    multiple of 16 values of at most max(max_elements, the smallest such piece); the last
    never under 16 values unless it is the only one (see the module docstring)."""
    unit = 16 // math.gcd(row_size, 16) if row_size else 1  # rows per 16 values
    per = max(unit, max_elements // max(row_size, 1) // unit * unit)
    bounds = list(range(0, rows, per)) + [rows]
    pieces = list(zip(bounds[:-1], bounds[1:]))
    if len(pieces) > 1 and (pieces[-1][1] - pieces[-1][0]) * row_size < 16:
        pieces[-2:] = [(pieces[-2][0], rows)]
    return pieces


@torch.no_grad()
def _initialize_shard(name: str, p: nn.Parameter, seed: int, tp_size: int, tp_rank: int,
                      max_elements: int) -> None:
    """This rank's slice of the parameter's full value, drawn piece by piece (see the module docstring)."""
    if p.init_kind in ("zeros", "ones"):
        p.fill_(1.0 if p.init_kind == "ones" else 0.0)
        return
    if p.init_kind != "normal":
        raise ValueError(f"unknown init kind {p.init_kind!r} for {name}")
    if p.dim() == 0:
        p.copy_(master_value(name, (), "normal", p.init_std, seed).to(p.dtype))
        return
    shape = full_shape(p, tp_size)
    sliced = getattr(p, "tensor_model_parallel", False)
    dim = p.partition_dim if sliced else 0
    # the full indices along `dim` this rank holds, in its own order (take_tp_slice's layout)
    held = take_tp_slice(torch.arange(shape[dim]), 0, p.partition_stride, tp_size, tp_rank) if sliced else None
    gen = _generator(name, seed)
    for a, b in row_pieces(shape[0], math.prod(shape[1:]), max_elements):
        piece = torch.empty((b - a, *shape[1:])).normal_(0.0, p.init_std, generator=gen).to(p.dtype)
        if held is None:
            p[a:b].copy_(piece)
        elif dim == 0:
            mine = ((held >= a) & (held < b)).nonzero().squeeze(1)  # local rows whose full row is here
            if mine.numel():
                p[mine.to(p.device)] = piece[held[mine] - a].to(p.device)
        else:
            p[a:b].copy_(piece.index_select(dim, held))


@torch.no_grad()
def initialize_parameters(named_params: Iterable[Tuple[str, nn.Parameter]], seed: int,
                          tp_size: int, tp_rank: int, max_host_elements: Optional[int] = None) -> None:
    """`max_host_elements` None: the exact path; a number: per shard (module docstring)."""
    for name, p in named_params:
        if max_host_elements is not None:
            _initialize_shard(name, p, seed, tp_size, tp_rank, max_host_elements)
            continue
        full = master_value(name, full_shape(p, tp_size), p.init_kind, p.init_std, seed)
        if getattr(p, "tensor_model_parallel", False):
            full = take_tp_slice(full, p.partition_dim, p.partition_stride, tp_size, tp_rank)
        p.copy_(full.to(dtype=p.dtype, device=p.device))


def materialize_parameters(module: nn.Module, device: torch.device) -> None:
    """Give every parameter built on the meta device uninitialised storage on `device`
    (initialize_parameters then writes every value), keeping its attributes (the partition
    metadata) and its sharing (one parameter registered in two modules stays one)."""
    made = {}
    for m in module.modules():
        for key, p in list(m._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in made:
                new = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)
                made[id(p)] = new
            m._parameters[key] = made[id(p)]
