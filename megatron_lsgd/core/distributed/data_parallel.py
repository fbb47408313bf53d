"""Data parallelism inside a site: gradients reduced over dp_intra every step, bucketed.

Cross-site reduction is *not* done here: that is the synchronizer's job (the `sync`
baseline all-reduces each rank's grad shard over dp_inter after this finishes).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ClassVar, List

import torch
import torch.distributed as dist
from torch import nn

from megatron_lsgd.core.distributed.collectives import reduce_scatter_flat
from megatron_lsgd.core.distributed.param_and_grad_buffer import Bucket, ParamAndGradBuffer
from megatron_lsgd.core.options import OptionGroup, option
from megatron_lsgd.core.parallel_state import ProcessGroups


@dataclass
class DDPConfig(OptionGroup):
    """Each field with a flag declares it here once (the command line's group of the same title)."""

    title: ClassVar[str] = "data parallelism inside a site (gradient buckets, ZeRO-1)"

    use_distributed_optimizer: bool = option(  # ZeRO-1: reduce-scatter instead of all-reduce
        "--use-distributed-optimizer", False,
        help="ZeRO-1: shard the inner optimizer state over the data-parallel ranks of a site")
    overlap_grad_reduce: bool = option("--overlap-grad-reduce", False,
                                       help="launch each bucket's intra-site gradient reduction as soon as backward "
                                            "fills it")
    bucket_size: int = option("--ddp-bucket-size", 40_000_000,  # 0 puts everything in one bucket
                              help="elements per gradient bucket")
    grad_dtype: torch.dtype = torch.float32


class DistributedDataParallel(nn.Module):
    def __init__(self, module: nn.Module, pgs: ProcessGroups, config: DDPConfig):
        super().__init__()
        self.module = module
        self.pgs = pgs
        self.config = config
        self.dp_intra_size = pgs.dp_intra_size
        num_shards = self.dp_intra_size if config.use_distributed_optimizer else 1
        params = [p for p in module.parameters() if p.requires_grad]
        params.reverse()  # roughly the order backward produces gradients
        # Sites of different DP sizes: every site pads its buckets to the lanes that cross
        # sites (parallel_state), so the buckets and their lanes are the same everywhere.
        self.buffer = ParamAndGradBuffer(params, bucket_size=config.bucket_size, num_shards=num_shards,
                                         grad_dtype=config.grad_dtype,
                                         pad_multiple=pgs.dims.lanes if pgs.dims.heterogeneous else None)
        self.is_last_microbatch = True
        self._pending = {}  # bucket index -> (work, scratch)
        self._bucket_remaining = {}
        self._unit_listeners: List[Callable[[object], None]] = []
        self._unit_of_param = {}
        self._unit_remaining = {}
        self._reset_counters()
        for p in params:
            p.register_post_accumulate_grad_hook(self._make_hook())

    # ---- module plumbing ---------------------------------------------------------------
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)

    @contextlib.contextmanager
    def no_sync(self):
        """Micro-batches inside accumulate only; the last one (outside) triggers reduces
        and per-unit post-backward notifications."""
        previous = self.is_last_microbatch
        self.is_last_microbatch = False
        try:
            yield
        finally:
            self.is_last_microbatch = previous

    def add_unit_backward_listener(self, units, listener: Callable[[object], None]) -> None:
        """Call `listener(unit)` once per step when every parameter of `unit` has its final
        gradient for the step (a layer's backward is done): DreamDDP-style hooks."""
        for unit in units:
            for p in unit.parameters():
                if p.requires_grad:
                    self._unit_of_param[id(p)] = unit
        self._unit_listeners.append(listener)
        self._reset_counters()

    # ---- gradient accumulation and reduction --------------------------------------------
    def _reset_counters(self) -> None:
        self._bucket_remaining = {b.index: len(b.params) for b in self.buffer.buckets}
        self._unit_remaining = {}
        for unit in self._unit_of_param.values():
            self._unit_remaining[id(unit)] = 0
        for unit in self._unit_of_param.values():
            self._unit_remaining[id(unit)] += 1

    def _make_hook(self):
        def hook(param: nn.Parameter):
            param.main_grad.add_(param.grad)
            param.grad = None
            if not self.is_last_microbatch:
                return
            bucket = self.buffer.param_to_bucket[id(param)]
            self._bucket_remaining[bucket.index] -= 1
            if self.config.overlap_grad_reduce and not bucket.deferred and self._bucket_remaining[bucket.index] == 0:
                self._launch(bucket)
            unit = self._unit_of_param.get(id(param))
            if unit is not None:
                self._unit_remaining[id(unit)] -= 1
                if self._unit_remaining[id(unit)] == 0:
                    for listener in self._unit_listeners:
                        listener(unit)
        return hook

    def zero_grad_buffer(self) -> None:
        self.buffer.zero_grad()
        self._pending.clear()
        self._reset_counters()

    def _launch(self, bucket: Bucket) -> None:
        if bucket.index in self._pending:
            return
        if self.dp_intra_size == 1:
            self._pending[bucket.index] = (None, None)
            return
        bucket.grad_data.mul_(1.0 / self.dp_intra_size)
        if bucket.num_shards > 1:
            scratch = torch.empty(bucket.shard_size, dtype=bucket.grad_data.dtype, device=bucket.grad_data.device)
            work = reduce_scatter_flat(scratch, bucket.grad_data, group=self.pgs.dp_intra, async_op=True)
        else:
            scratch = None
            work = dist.all_reduce(bucket.grad_data, group=self.pgs.dp_intra, async_op=True)
        self._pending[bucket.index] = (work, scratch)

    def _model_parallel_grad_reduce(self) -> None:
        """Grads that are partial per model-parallel rank: tied word embeddings (first and
        last stage) and sequence-parallel replicated params (norms, row-parallel biases)."""
        for bucket in self.buffer.buckets:
            if not bucket.deferred:
                continue
            for p in bucket.params:
                if getattr(p, "sequence_parallel", False) and self.pgs.dims.tp > 1:
                    dist.all_reduce(p.main_grad, group=self.pgs.tp)
                if getattr(p, "shared_embedding", False) and self.pgs.dims.pp > 1:
                    dist.all_reduce(p.main_grad, group=self.pgs.embedding)

    def finish_grad_sync(self) -> None:
        """After the last micro-batch's backward: every bucket reduced within the site.
        With ZeRO-1 only this rank's shard of each bucket is valid afterwards."""
        self._model_parallel_grad_reduce()
        for bucket in self.buffer.buckets:
            self._launch(bucket)
        rank = self.pgs.dp_intra_rank
        for bucket in self.buffer.buckets:
            work, scratch = self._pending[bucket.index]
            if work is not None:
                work.wait()
            if scratch is not None:
                bucket.grad_shard(rank).copy_(scratch)
        self._pending.clear()

    # ---- what other components read -------------------------------------------------------
    @property
    def buckets(self) -> List[Bucket]:
        return self.buffer.buckets

    def local_grad_shards(self) -> List[torch.Tensor]:
        """The slices of the grad buffer this rank owns after finish_grad_sync."""
        shard = self.pgs.dp_intra_rank if self.config.use_distributed_optimizer else 0
        return [b.grad_shard(shard) for b in self.buffer.buckets]

    def grad_shards(self, storage: int) -> List[torch.Tensor]:
        """Like local_grad_shards, in gradient storage `storage` (ParamAndGradBuffer's
        double buffering) rather than the active one."""
        shard = self.pgs.dp_intra_rank if self.config.use_distributed_optimizer else 0
        out = []
        for b in self.buffer.buckets:
            lo, hi = b.shard_range(shard)
            out.append(self.buffer.bucket_grad(b, storage)[lo:hi])
        return out

    @property
    def active_grad_storage(self) -> int:
        """The gradient storage backward accumulates into now (ParamAndGradBuffer's double buffering)."""
        return self.buffer.active_grad_storage

    def scale_grads(self, factor: float) -> None:
        """Multiply the active gradient storage in place (every bucket, padding included)."""
        self.buffer.grad_data.mul_(factor)

    def add_grad_storage(self) -> int:
        """Another gradient storage for double buffering (ParamAndGradBuffer.add_grad_storage)."""
        return self.buffer.add_grad_storage()

    def use_grad_storage(self, index: int) -> None:
        """Backward accumulates into storage `index` from now on; zero_grad_buffer and
        finish_grad_sync act on it. Call only with no reduction in flight."""
        if self._pending:
            raise RuntimeError("use_grad_storage with intra-site reductions in flight")
        self.buffer.use_grad_storage(index)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model
