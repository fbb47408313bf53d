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
each rank's elapsed time (the run's clock, core/clock.py) is all-reduced (MAX) over all
ranks on a small gloo group of its own, asynchronously and one step late: the 8-byte
collective's latency (a WAN round trip) hides behind a step, and every rank reads the same
elapsed time, so the same verdict and message, at the same iteration. Under
--simulate-clock the elapsed times are virtual and the stop is exactly reproducible.
Algorithms whose sites take different numbers of steps (`Synchronizer.lockstep = False`)
decide in `Synchronizer.agree_to_stop`, at the points where their sites meet, by the shared
rule `protocol.stop_at_meeting`: the job's sample budget (--train-iters then counts global
batches) or a site's --exit-duration-in-mins. --exit-interval then pauses at the first
meeting at or past a multiple of it, counted in the job's global batches (the loop checks it).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_lsgd.core.clock import Clock
from megatron_lsgd.core.lsgd.protocol import Progress, Stop


class StopVote:
    """One-step-late agreement: `cast(value)` returns the maximum over all ranks of the
    values cast in the previous call (None before any), and casts this one. The group is
    gloo, so the value is a host tensor."""

    def __init__(self, group):
        self.group = group
        self._value: Optional[torch.Tensor] = None
        self._work = None

    def cast(self, value: float) -> Optional[float]:
        agreed = self.close()
        self._value = torch.tensor([value], dtype=torch.float64)
        self._work = dist.all_reduce(self._value, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return agreed

    def close(self) -> Optional[float]:
        """Wait for the vote in flight (if any) and return its maximum."""
        if self._work is None:
            return None
        self._work.wait()
        self._work = None
        return float(self._value.item())


class Termination:
    def __init__(self, training_config, synchronizer, clock: Clock, world_ranks):
        self.cfg = training_config
        self.synchronizer = synchronizer
        self.clock = clock
        self.duration_s = 60.0 * training_config.exit_duration_in_mins \
            if training_config.exit_duration_in_mins is not None else None
        self.vote = None
        if self.duration_s is not None and synchronizer.lockstep and dist.is_initialized():
            # Collective: every rank runs this constructor with the same config.
            self.vote = StopVote(dist.new_group(list(world_ranks), backend="gloo"))

    def elapsed(self) -> float:
        return self.clock.elapsed()

    def after_step(self, iteration: int, site_samples: int) -> Optional[Stop]:
        if not self.synchronizer.lockstep:
            progress = Progress(iteration, site_samples, self.elapsed(), self.cfg.train_iters, self.cfg.train_samples,
                                self.duration_s, self.cfg.global_batch_size)
            return self.synchronizer.agree_to_stop(progress)
        elapsed = self.vote.cast(self.elapsed()) if self.vote is not None else None  # all ranks', a step ago
        if iteration >= self.cfg.train_iters:
            return Stop(True, f"--train-iters {self.cfg.train_iters}")
        if elapsed is not None and elapsed >= self.duration_s:
            return Stop(False, f"--exit-duration-in-mins {self.cfg.exit_duration_in_mins:g}: "
                               f"{elapsed / 60:.2f} min elapsed")
        if self.cfg.exit_interval and iteration % self.cfg.exit_interval == 0:
            return Stop(False, f"--exit-interval {self.cfg.exit_interval}")
        return None

    def close(self) -> None:
        if self.vote is not None:
            self.vote.close()
