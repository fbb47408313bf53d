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
common loss divisor, apply(grads=..., groups=..., copy_to_model=False) and trial_apply on
a thread of their own (see protocol.InnerStep).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional, Tuple

import torch

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
                 spec: Callable[..., ScheduleSpec], num_microbatches: int, straggler, phase: UnitHookPhase):
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
        self.iteration = 0  # set by the loop before each step (straggler draws are per step)

    @property
    def num_microbatches(self) -> int:
        return self._num_microbatches

    def zero_grads(self) -> None:
        self.model.zero_grad_buffer()

    def compute_grads(self, data_iterator, num_microbatches: Optional[int] = None, *,
                      loss_divisor: Optional[int] = None, accumulate_only: bool = False
                      ) -> List[Dict[str, torch.Tensor]]:
        n = num_microbatches or self._num_microbatches
        self.model.train()
        self.phase.training, self.phase.count = True, n
        accumulate = self.model.no_sync() if accumulate_only else contextlib.nullcontext()
        try:
            with self._straggler.around_compute(self.iteration), accumulate:
                return self._forward_backward(self._forward_step_func, data_iterator, self.model,
                                              self._spec(forward_only=False, num_microbatches=n,
                                                         on_forward=self.phase.forward, loss_divisor=loss_divisor),
                                              self.pgs)
        finally:
            self.phase.training = False

    def reduce_in_site(self) -> None:
        self.model.finish_grad_sync()

    def apply(self, *, grads=None, groups=None, copy_to_model: bool = True) -> Tuple[bool, Optional[float]]:
        ok, norm = self.optimizer.step(self.scheduler.next_lr(), grads=grads, groups=groups,
                                       copy_to_model=copy_to_model)
        if ok:
            self.scheduler.step()
        return ok, norm

    def trial_apply(self, out, *, grads=None, groups=None) -> Tuple[bool, Optional[float]]:
        return self.optimizer.trial_step(self.scheduler.next_lr(), out, grads=grads, groups=groups)
