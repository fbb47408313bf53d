"""When the run stops, at the same step on every rank: one stop rule per training loop,
each built by its loop (the loop is chosen once, by the synchronizer's `lockstep`; nothing
here asks which it is).

Conditions, checked after every inner step:
- `--train-iters N` (or a budget, `--train-samples` / `--train-tokens`, which build_config
  turns into N = budget // global batch): training *ends*; the synchronizer's
  finish_training closes its rounds so every site holds the same final model.
- `--exit-interval N`: the run *pauses* at multiples of N (save, exit; a resumed run
  continues exactly as if it had not stopped, so nothing is closed early).
- `--exit-duration-in-mins M`: the run pauses once M minutes have passed since start-up
  (Megatron's meaning: leave in time before a job's time limit, with a checkpoint).
- `--exit-signal-handler`: a noted SIGTERM pauses the run like time running out.

`StepCountTermination` (the lockstep loop's): iteration counts agree on every rank by
construction. Clocks do not, so each rank's elapsed time (the run's clock, core/clock.py)
is all-reduced (MAX) over the world's ranks on a small gloo group of its own,
asynchronously and one step late: the 8-byte collective's latency (a WAN round trip) hides
behind a step, and every rank reads the same elapsed time, so the same verdict and message,
at the same iteration. Under fault tolerance (--lsgd-fault-tolerance) the world is one
site: its ranks agree, and a site that pauses for time or a signal leaves the others as a
failed site would (they go on, or wait at --lsgd-min-sites); no vote crosses sites, so a
dead site cannot stall it. Under --simulate-clock the elapsed times are virtual and the
stop is exactly reproducible.

`MeetingTermination` (the meeting loop's, for algorithms whose sites take different
numbers of steps, `Synchronizer.lockstep = False`): the synchronizer decides in
`agree_to_stop`, at the points where its sites meet, by the shared rule
`protocol.stop_at_meeting`: the job's sample budget (--train-iters then counts global
batches) or a site's --exit-duration-in-mins (a noted signal ends a site's time).
--exit-interval then pauses at the first meeting at or past a multiple of it, counted in
the job's global batches (`at_meeting`, which the meeting loop asks once it has taken the
meeting's progress).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from megatron_lsgd.core.clock import Clock
from megatron_lsgd.core.lsgd.protocol import Progress, Stop


def crossed(before: int, now: int, interval: Optional[int]) -> bool:
    """A multiple of `interval` lies in (before, now]."""
    return bool(interval) and now // interval > before // interval


class StopVote:
    """One-step-late agreement: `cast(elapsed, signalled)` returns the maximum elapsed time
    over all ranks and whether any rank was signalled, as cast in the previous call (None
    before any), and casts these. The group is gloo, so the values are a host tensor."""

    def __init__(self, group):
        self.group = group
        self._value: Optional[torch.Tensor] = None
        self._work = None

    def cast(self, elapsed: float, signalled: bool) -> Optional[Tuple[float, bool]]:
        agreed = self.close()
        self._value = torch.tensor([elapsed, 1.0 if signalled else 0.0], dtype=torch.float64)
        self._work = dist.all_reduce(self._value, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return agreed

    def close(self) -> Optional[Tuple[float, bool]]:
        """Wait for the vote in flight (if any) and return its maximum elapsed time and signal."""
        if self._work is None:
            return None
        self._work.wait()
        self._work = None
        elapsed, signalled = self._value.tolist()
        return elapsed, signalled > 0


class Termination(ABC):
    """What both stop rules share: the run's clock, --exit-duration-in-mins and the signals;
    each loop's rule (below) decides after a step."""

    def __init__(self, training_config, clock: Clock, signals=None):
        self.cfg = training_config
        self.signals = signals  # --exit-signal-handler: a noted SIGTERM pauses the run like time running out
        self.clock = clock
        self.duration_s = 60.0 * training_config.exit_duration_in_mins \
            if training_config.exit_duration_in_mins is not None else None

    def elapsed(self) -> float:
        return self.clock.elapsed()

    def signalled(self) -> bool:
        return self.signals is not None and self.signals.noted is not None

    @abstractmethod
    def after_step(self, iteration: int, site_samples: int) -> Optional[Stop]:
        """The stop this step calls for, or None to go on."""

    def _signal_reason(self) -> str:
        return f"--exit-signal-handler: {self.signals.noted or 'SIGTERM'} on some rank"

    def close(self) -> None:
        """Nothing in flight to wait for (the lockstep rule's vote overrides this)."""


class StepCountTermination(Termination):
    """The lockstep loop's rule: stop at step counts; elapsed time and signals are agreed
    over the world's ranks one step late."""

    def __init__(self, training_config, clock: Clock, signals=None):
        super().__init__(training_config, clock, signals)
        self.vote = None
        watch_signals = signals is not None and signals.exit_signal_handler
        if (self.duration_s is not None or watch_signals) and dist.is_initialized():
            # Collective: every rank runs this constructor with the same config.
            self.vote = StopVote(dist.new_group(list(range(dist.get_world_size())), backend="gloo"))

    def after_step(self, iteration: int, site_samples: int) -> Optional[Stop]:
        signalled = self.signalled()
        # every rank's elapsed time and signal, a step ago
        agreed = self.vote.cast(self.elapsed(), signalled) if self.vote is not None else None
        elapsed, any_signal = agreed if agreed is not None else (None, False)
        if iteration >= self.cfg.train_iters:
            return Stop(True, f"--train-iters {self.cfg.train_iters}")
        if any_signal:
            return Stop(False, self._signal_reason())
        if elapsed is not None and self.duration_s is not None and elapsed >= self.duration_s:
            return Stop(False, f"--exit-duration-in-mins {self.cfg.exit_duration_in_mins:g}: "
                               f"{elapsed / 60:.2f} min elapsed")
        if self.cfg.exit_interval and iteration % self.cfg.exit_interval == 0:
            return Stop(False, f"--exit-interval {self.cfg.exit_interval}")
        return None

    def close(self) -> None:
        if self.vote is not None:
            self.vote.close()


class MeetingTermination(Termination):
    """The meeting loop's rule: the synchronizer's `agree_to_stop`, where its sites meet."""

    def __init__(self, training_config, synchronizer, clock: Clock, signals=None):
        super().__init__(training_config, clock, signals)
        self.synchronizer = synchronizer

    def after_step(self, iteration: int, site_samples: int) -> Optional[Stop]:
        signalled = self.signalled()  # a noted signal ends the time at the next meeting
        progress = Progress(iteration, site_samples, self.elapsed(), self.cfg.train_iters, self.cfg.train_samples,
                            0.0 if signalled else self.duration_s, self.cfg.global_batch_size)
        stop = self.synchronizer.agree_to_stop(progress)
        return Stop(False, self._signal_reason()) if signalled and stop and not stop.ends_training else stop

    def at_meeting(self, stop: Optional[Stop], before: int, agreed: int) -> Optional[Stop]:
        """At a meeting that moved the job's progress from `before` to `agreed` global
        batches: --exit-interval pauses at the first meeting at or past a multiple of it."""
        if stop is None and crossed(before, agreed, self.cfg.exit_interval):
            return Stop(False, f"--exit-interval {self.cfg.exit_interval}")
        return stop
