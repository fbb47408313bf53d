"""When the run stops, at the same step on every rank.

Conditions, checked after every inner step:
- `--train-iters N` (or a budget, `--train-samples` / `--train-tokens`, which build_config
  turns into N = budget // global batch): training *ends*; the synchronizer's
  finish_training closes its rounds so every site holds the same final model.
- `--exit-interval N`: the run *pauses* at multiples of N (save, exit; a resumed run
  continues exactly as if it had not stopped, so nothing is closed early).
- `--exit-duration-in-mins M`: the run pauses once M minutes have passed since start-up
  (Megatron's meaning: leave in time before a job's time limit, with a checkpoint).

Iteration counts agree on every rank of a lockstep run by construction. Clocks do not, so
each rank's "time is up" is all-reduced (MAX) over all ranks on a small gloo group of its
own, asynchronously and one step late: the 4-byte collective's latency (a WAN round trip)
hides behind a step, and every rank reads the same verdict at the same iteration.
Algorithms whose sites take different numbers of steps (`Synchronizer.lockstep = False`)
decide in `Synchronizer.agree_to_stop`, at the points where their sites meet, by the shared
rule `protocol.stop_at_meeting`: the job's sample budget (--train-iters then counts global
batches) or a site's --exit-duration-in-mins. --exit-interval then pauses at the first
meeting at or past a multiple of it, counted in the job's global batches (the loop checks it).
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

from megatron_lsgd.core.lsgd.protocol import Progress, Stop


TIME_UP, SIGNALLED = 1, 2  # the reasons a vote can carry, as bits


class StopVote:
    """One-step-late agreement: `cast(reasons)` returns the OR over all ranks of the reason
    bits cast in the previous call, and casts these."""

    def __init__(self, group):
        self.group = group
        self._flag: Optional[torch.Tensor] = None
        self._work = None

    def cast(self, reasons: int) -> int:
        agreed = self.close()
        self._flag = torch.tensor([reasons & bit for bit in (TIME_UP, SIGNALLED)], dtype=torch.int32)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return agreed

    def close(self) -> int:
        """Wait for the vote in flight (if any) and return its verdict."""
        if self._work is None:
            return 0
        self._work.wait()
        self._work = None
        return int(self._flag.sum().item())


class Termination:
    def __init__(self, training_config, synchronizer, start_time: float, world_ranks, signals=None):
        self.cfg = training_config
        self.signals = signals  # --exit-signal-handler: a noted SIGTERM pauses the run like time running out
        self.synchronizer = synchronizer
        self.start_time = start_time
        self.duration_s = 60.0 * training_config.exit_duration_in_mins \
            if training_config.exit_duration_in_mins is not None else None
        self.vote = None
        watch_signals = signals is not None and signals.exit_signal_handler
        if (self.duration_s is not None or watch_signals) and synchronizer.lockstep and dist.is_initialized():
            # Collective: every rank runs this constructor with the same config.
            self.vote = StopVote(dist.new_group(list(world_ranks), backend="gloo"))

    def elapsed(self) -> float:
        return time.monotonic() - self.start_time

    def after_step(self, iteration: int, site_samples: int) -> Optional[Stop]:
        signalled = self.signals is not None and self.signals.noted is not None
        if not self.synchronizer.lockstep:  # a noted signal ends the time at the next meeting
            progress = Progress(iteration, site_samples, self.elapsed(), self.cfg.train_iters, self.cfg.train_samples,
                                0.0 if signalled else self.duration_s, self.cfg.global_batch_size)
            stop = self.synchronizer.agree_to_stop(progress)
            return Stop(False, self._signal_reason()) if signalled and stop and not stop.ends_training else stop
        verdict = 0
        if self.vote is not None:
            time_up = self.duration_s is not None and self.elapsed() >= self.duration_s
            verdict = self.vote.cast((TIME_UP if time_up else 0) | (SIGNALLED if signalled else 0))
        if iteration >= self.cfg.train_iters:
            return Stop(True, f"--train-iters {self.cfg.train_iters}")
        if verdict & SIGNALLED:
            return Stop(False, self._signal_reason())
        if verdict & TIME_UP:
            return Stop(False, f"--exit-duration-in-mins {self.cfg.exit_duration_in_mins:g}: "
                               f"{self.elapsed() / 60:.2f} min elapsed")
        if self.cfg.exit_interval and iteration % self.cfg.exit_interval == 0:
            return Stop(False, f"--exit-interval {self.cfg.exit_interval}")
        return None

    def _signal_reason(self) -> str:
        return f"--exit-signal-handler: {self.signals.noted or 'SIGTERM'} on some rank"

    def close(self) -> None:
        if self.vote is not None:
            self.vote.close()
