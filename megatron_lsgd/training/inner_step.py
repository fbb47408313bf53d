"""One inner training step as named parts, for a synchronizer to compose
(`Synchronizer.train_step`; the protocol's InnerStep).

    zero_grads()        empty the fp32 grad buffer (and the DDP layer's reduce bookkeeping)
    compute_grads(...)  the pipeline schedule over the micro-batches: forward, backward,
                        gradients accumulated into main_grad; unit hooks fire in here
    reduce_in_site()    TP/embedding reduces, then every bucket over dp_intra
    apply()             clip + inner optimizer on this rank's shard at the scheduled LR,
                        main -> model (ZeRO-1 all-gather inside the site)

The default composition (protocol.Synchronizer.train_step) is the plain synchronous step.
ACCO/DPU compose them with overlap: several accumulate-only compute_grads calls with a
common loss divisor, apply(grads=..., groups=..., copy_to_model=False, samples=...) and
trial_apply on a thread of their own (see protocol.InnerStep).

Megatron options folded into the parts: a batch-size schedule sets the micro-batch count
before each step (`set_num_microbatches`); with --calculate-per-token-loss, compute_grads
counts the site's loss tokens and reduce_in_site scales the reduced gradients by them;
apply advances a sample-based LR schedule by the step's samples and gives the embedding
and output layer their decoupled LR; --empty-unused-memory-level releases cached CUDA
memory after compute_grads (1) and apply (2).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_lsgd.core.clock import Clock
from megatron_lsgd.core.lsgd.protocol import MicroBatch
from megatron_lsgd.core.pipeline_parallel.schedules import ScheduleSpec


class UnitHookPhase:
    """Where the unit hooks are: training or not, and which micro-batch is computing."""

    def __init__(self):
        self.training = False
        self.index = 0
        self.count = 1

    def forward(self, index: int) -> None:
        self.index = index

    def current(self) -> MicroBatch:
        return MicroBatch(self.index, self.count)

    def last(self) -> MicroBatch:
        return MicroBatch(self.count - 1, self.count)


class InnerStep:
    def __init__(self, model, optimizer, scheduler, pgs, forward_backward: Callable, forward_step_func: Callable,
                 spec: Callable[..., ScheduleSpec], num_microbatches: int, straggler, phase: UnitHookPhase,
                 clock: Clock, samples_per_microbatch: int = 0, empty_unused_memory_level: int = 0):
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.pgs = pgs
        self._forward_backward = forward_backward
        self._forward_step_func = forward_step_func
        self._spec = spec
        self._num_microbatches = num_microbatches
        self._straggler = straggler
        self.phase = phase
        self.clock = clock  # charged for the compute (a simulated clock; the real one needs nothing)
        self.iteration = 0  # set by the loop before each step (straggler draws are per step)
        self.samples_per_microbatch = samples_per_microbatch  # micro batch x data-parallel size (all sites)
        self.empty_unused_memory_level = empty_unused_memory_level
        self._last_microbatches = num_microbatches
        self._site_tokens: Optional[torch.Tensor] = None  # --calculate-per-token-loss: this step's loss tokens
        # What one reduction inside the site moves per rank (the fp32 gradient buffer).
        self._grad_bytes = sum(b.grad_data.numel() * b.grad_data.element_size() for b in model.buckets)
        self._grad_device = next(iter(model.buckets)).grad_data.device

    @property
    def num_microbatches(self) -> int:
        return self._num_microbatches

    def set_num_microbatches(self, n: int) -> None:
        """A batch-size schedule (--rampup-batch-size) sets the coming step's count."""
        self._num_microbatches = n

    def _empty_cache(self, level: int) -> None:
        if self.empty_unused_memory_level >= level and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def zero_grads(self) -> None:
        self.model.zero_grad_buffer()

    def compute_grads(self, data_iterator, num_microbatches: Optional[int] = None, *,
                      loss_divisor: Optional[int] = None, accumulate_only: bool = False
                      ) -> List[Dict[str, torch.Tensor]]:
        n = num_microbatches or self._num_microbatches
        self.model.train()
        self.phase.training, self.phase.count = True, n
        spec = self._spec(forward_only=False, num_microbatches=n, on_forward=self.phase.forward,
                          loss_divisor=loss_divisor)
        accumulate = self.model.no_sync() if accumulate_only else contextlib.nullcontext()
        try:
            with self._straggler.around_compute(self.iteration), accumulate, self.clock.computing(n):
                losses = self._forward_backward(self._forward_step_func, data_iterator, self.model, spec, self.pgs)
        finally:
            self.phase.training = False
        self._last_microbatches = n
        self._site_tokens = self._count_site_tokens(spec) if spec.per_token_loss else None
        self._empty_cache(1)
        return losses

    def _count_site_tokens(self, spec: ScheduleSpec) -> torch.Tensor:
        """The loss tokens of the whole step on this site: the last stage counted them, the
        other stages learn it through the pipeline group, and the site's replicas add up."""
        device = next(iter(self.model.buckets)).grad_data.device
        count = torch.zeros(1, dtype=torch.float64, device=device)
        if spec.num_tokens is not None:
            count += spec.num_tokens.to(device=device, dtype=torch.float64)
        dims = self.pgs.dims
        if dims.pp > 1:
            dist.all_reduce(count, group=self.pgs.pp)
        if self.pgs.dp_intra_size > 1:
            dist.all_reduce(count, group=self.pgs.dp_intra)
        return count

    def reduce_in_site(self) -> None:
        self.model.finish_grad_sync()
        self.clock.intra_site(self._grad_bytes, self.pgs.dp_intra_size, self.pgs.site, self._grad_device)
        if self._site_tokens is not None:
            # Backward summed token losses; the reduction averaged them over dp_intra. One
            # scale makes the gradient the site's per-token mean: x dp_intra / tokens.
            factor = self.pgs.dp_intra_size / max(float(self._site_tokens.item()), 1.0)
            for bucket in self.model.buckets:
                bucket.grad_data.mul_(factor)

    def apply(self, *, grads=None, groups=None, copy_to_model: bool = True,
              samples: Optional[int] = None) -> Tuple[bool, Optional[float]]:
        """`samples`: the step's global batch for a sample-based LR schedule (default: the
        last compute_grads call's micro-batches on every site)."""
        samples = self._last_microbatches * self.samples_per_microbatch if samples is None else samples
        ok, norm = self.optimizer.step(self.scheduler.next_lrs(samples), grads=grads, groups=groups,
                                       copy_to_model=copy_to_model)
        self.clock.optimizer_step()
        if ok:
            self.scheduler.step(samples)
        self._empty_cache(2)
        return ok, norm

    @property
    def current_lr(self) -> float:
        return self.scheduler.current_lr

    def trial_apply(self, out, *, grads=None, groups=None, samples: Optional[int] = None
                    ) -> Tuple[bool, Optional[float]]:
        samples = self._last_microbatches * self.samples_per_microbatch if samples is None else samples
        result = self.optimizer.trial_step(self.scheduler.next_lrs(samples), out, grads=grads, groups=groups)
        self.clock.optimizer_step()
        return result
