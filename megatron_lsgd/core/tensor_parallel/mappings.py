"""Autograd-aware collectives for tensor and sequence parallelism.

Each function is an identity/collective pair: the forward does one thing, the backward
does its conjugate (copy <-> all-reduce, split <-> gather, all-gather <-> reduce-scatter).
Sequence-parallel tensors are [s, b, h] and are split along dim 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lsgd.core.distributed.collectives import all_gather_flat, reduce_scatter_flat


def _world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if _world(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _split_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    return x.chunk(world, dim=-1)[dist.get_rank(group)].contiguous()


def _gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def all_gather_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    x = x.contiguous()
    out = torch.empty((x.shape[0] * world,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_flat(out, x, group=group)
    return out


def reduce_scatter_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    if x.shape[0] % world:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by tensor-parallel size {world}")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // world,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_flat(out, x, group=group)
    return out


def _split_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    if x.shape[0] % world:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by tensor-parallel size {world}")
    return x.chunk(world, dim=0)[dist.get_rank(group)].contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx, g):
        return _gather_last_dim(g, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, g):
        return _split_last_dim(g, ctx.group), None


class _ScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_first_dim(x, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather_first_dim(g, ctx.group), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    """All-gather the sequence for a column-parallel matmul; its gradient is partial per
    rank (each rank multiplied by its own weight slice), so the backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_first_dim(x, group)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter_first_dim(g, ctx.group), None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_first_dim(x, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather_first_dim(g, ctx.group), None


def copy_to_tensor_parallel_region(x, group):
    return _CopyToRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x, group):
    return _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x, group):
    return _ScatterToRegion.apply(x, group)


def gather_from_tensor_parallel_region(x, group):
    return _GatherFromRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x, group):
    return _ScatterToSequenceRegion.apply(x, group)


def gather_from_sequence_parallel_region(x, group):
    return _GatherFromSequenceRegion.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x, group):
    return _ReduceScatterToSequenceRegion.apply(x, group)
