"""Contiguous parameter and gradient storage, split into buckets.

Parameters become views into one flat buffer and accumulate their gradients into views
(`param.main_grad`) of one flat fp32 buffer. Each bucket is padded to a multiple of the
number of ZeRO-1 shards so that every shard is an equal contiguous slice: shard r of a
bucket is what rank r of the site reduces, optimizes and (across sites) exchanges.

Gradients can be double-buffered (ACCO/DPU compute the next step's gradients while the
previous ones are still being reduced and applied): `add_grad_storage()` allocates another
flat fp32 gradient storage with the same layout, and `use_grad_storage(i)` makes
`param.main_grad`, `bucket.grad_data` and `grad_data` view storage i, so backward
accumulates there while the other storages are left alone. Storage 0 is the one built
here; a buffer that never calls these behaves exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch
from torch import nn


@dataclass
class Bucket:
    index: int
    params: List[nn.Parameter]
    start: int  # offset of the bucket in the flat buffers
    end: int  # padded end
    num_shards: int
    param_data: torch.Tensor = field(repr=False, default=None)
    grad_data: torch.Tensor = field(repr=False, default=None)
    # True for buckets of params whose grads first need a model-parallel all-reduce
    # (tied embeddings across stages, sequence-parallel norms): never reduced early.
    deferred: bool = False

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def shard_size(self) -> int:
        return self.numel // self.num_shards

    def shard_range(self, shard: int) -> Tuple[int, int]:
        """[lo, hi) of a shard, relative to the bucket start."""
        return shard * self.shard_size, (shard + 1) * self.shard_size

    def param_shard(self, shard: int) -> torch.Tensor:
        lo, hi = self.shard_range(shard)
        return self.param_data[lo:hi]

    def grad_shard(self, shard: int) -> torch.Tensor:
        lo, hi = self.shard_range(shard)
        return self.grad_data[lo:hi]


def _needs_model_parallel_reduce(p: nn.Parameter) -> bool:
    return getattr(p, "shared_embedding", False) or getattr(p, "sequence_parallel", False)


class ParamAndGradBuffer:
    def __init__(self, params: List[nn.Parameter], *, bucket_size: int, num_shards: int,
                 grad_dtype: torch.dtype = torch.float32, pad_multiple: Optional[int] = None):
        if not params:
            raise ValueError("no trainable parameters on this rank")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"parameters of one buffer must share a dtype, got {dtypes}")
        self.param_dtype = dtypes.pop()
        self.grad_dtype = grad_dtype
        self.num_shards = num_shards
        device = params[0].device

        # Params arrive in (approximate) backward order; special ones go last, in their
        # own buckets, so regular buckets can be reduced as soon as backward fills them.
        regular = [p for p in params if not _needs_model_parallel_reduce(p)]
        special = [p for p in params if _needs_model_parallel_reduce(p)]
        layout: List[Tuple[List[nn.Parameter], bool]] = []
        for group, deferred in ((regular, False), (special, True)):
            current: List[nn.Parameter] = []
            size = 0
            for p in group:
                current.append(p)
                size += p.numel()
                if bucket_size > 0 and size >= bucket_size:
                    layout.append((current, deferred))
                    current, size = [], 0
            if current:
                layout.append((current, deferred))

        self.buckets: List[Bucket] = []
        self.param_offsets = {}  # id(param) -> (start, end) in the flat buffers
        offset = 0
        for index, (bucket_params, deferred) in enumerate(layout):
            start = offset
            for p in bucket_params:
                self.param_offsets[id(p)] = (offset, offset + p.numel())
                offset += p.numel()
            # a multiple of the shard count, or of pad_multiple (sites of different DP sizes:
            # the lanes that cross sites, a multiple of every site's shard count)
            multiple = pad_multiple or num_shards
            padded = -(-(offset - start) // multiple) * multiple
            offset = start + padded
            self.buckets.append(Bucket(index, bucket_params, start, offset, num_shards, deferred=deferred))

        self.param_data = torch.zeros(offset, dtype=self.param_dtype, device=device)
        self.grad_data = torch.zeros(offset, dtype=grad_dtype, device=device)
        for b in self.buckets:
            b.param_data = self.param_data[b.start:b.end]
            b.grad_data = self.grad_data[b.start:b.end]
            for p in b.params:
                lo, hi = self.param_offsets[id(p)]
                view = self.param_data[lo:hi].view_as(p)
                view.copy_(p.data)
                p.data = view
                p.main_grad = self.grad_data[lo:hi].view_as(p)
        self.param_to_bucket = {id(p): b for b in self.buckets for p in b.params}
        self.grad_storages: List[torch.Tensor] = [self.grad_data]
        self.active_grad_storage = 0

    def zero_grad(self) -> None:
        """Zero the active gradient storage."""
        self.grad_data.zero_()

    # ---- double-buffered gradients ------------------------------------------------------------
    def add_grad_storage(self) -> int:
        """Allocate another gradient storage (zeros, same layout); returns its index."""
        self.grad_storages.append(torch.zeros_like(self.grad_storages[0]))
        return len(self.grad_storages) - 1

    def use_grad_storage(self, index: int) -> None:
        """Point `main_grad` of every parameter, every bucket's `grad_data` and `grad_data`
        at storage `index` (backward accumulates there from now on)."""
        data = self.grad_storages[index]
        self.grad_data = data
        for b in self.buckets:
            b.grad_data = data[b.start:b.end]
            for p in b.params:
                lo, hi = self.param_offsets[id(p)]
                p.main_grad = data[lo:hi].view_as(p)
        self.active_grad_storage = index

    def bucket_grad(self, bucket: Bucket, storage: int) -> torch.Tensor:
        """A bucket's gradients in storage `storage` (whichever storage is active)."""
        return self.grad_storages[storage][bucket.start:bucket.end]

    def shard_pieces(self, bucket: Bucket, shard: int):
        """(param, lo, hi, shard_lo, shard_hi): the part [lo, hi) of each param (in its
        flattened coordinates) that falls into `shard`, and where it sits in the shard."""
        s_lo, s_hi = bucket.shard_range(shard)
        s_lo += bucket.start
        s_hi += bucket.start
        for p in bucket.params:
            p_lo, p_hi = self.param_offsets[id(p)]
            lo, hi = max(p_lo, s_lo), min(p_hi, s_hi)
            if lo < hi:
                yield p, lo - p_lo, hi - p_lo, lo - s_lo, hi - s_lo
