"""The one clock of a run: every place that reads or spends time asks it.

The training loop's timers, the inter-site link and its accounting of exposed
communication, the algorithms' timing decisions (a-edit's interval, cocodc's step and sync
times, acco/dpu's accumulate-while-waiting, dreamddp's profile), stragglers and the
`--exit-duration-in-mins` budget all take time from one `Clock`, passed explicitly.

- `Clock` (the default) is real time: `now()` is `time.perf_counter()`, `sleep()` sleeps,
  and the compute charges (`compute`, `optimizer_step`, `intra_site`) cost nothing extra,
  because the work itself took the time. On a GPU (`for_device`), `now()` first waits
  until the calling thread's current stream has run what was queued on it: kernels run
  asynchronously, and a host reading alone would time their launches (exposed
  communication near 0, straggler sleeps scaled by launch time, a profile of launches).
  With that wait every reading means what it means on the host, in one place; on the host
  the wait is a no-op (core/streams.py) and the readings are unchanged. `mark()` and
  `seconds(a, b)` time work inside a step without waiting: on a GPU with events queued on
  the current stream, on the host with the present.
- `SimulatedClock` (core/simulation.py, `--simulate-clock`) keeps virtual time: compute is
  charged from a cost model, inter-site transfers from a link model, and nothing sleeps.

Work handed to another thread (acco/dpu's worker) runs on a timeline of its own:
`start_job()` forks one at the caller's present, `bound(job)` makes it the thread's clock,
`job.finish()` marks its end; the caller asks `done_by_now(job)` (has it finished by my
present?), `join(job)` (I waited for it) and `job.seconds()` (how long it took). With the
real clock these are the plain questions about the thread.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from typing import Iterable, Iterator, Optional

import torch

from megatron_lsgd.core.streams import HOST, streams_for


class Job:
    """A piece of work on another thread, with its own timeline (see the module docstring)."""

    def __init__(self, start: float):
        self.start = start
        self.t = start  # its present: a simulated clock advances it; at the end, where it ended
        self._finished = threading.Event()
        self._changed = threading.Condition()

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def finish(self) -> None:
        with self._changed:
            self._finished.set()
            self._changed.notify_all()

    def seconds(self) -> float:
        """How long the finished job took, from its start to its end on its timeline."""
        return self.t - self.start

    def advance_to(self, t: float) -> None:
        with self._changed:
            self.t = max(self.t, t)
            self._changed.notify_all()

    def wait_past(self, t: float) -> None:
        """Block until the job has finished or its present is beyond t."""
        with self._changed:
            self._changed.wait_for(lambda: self._finished.is_set() or self.t > t)


class Waits:
    """The waits for communication one thread recorded inside `Clock.counting_waits`."""

    def __init__(self):
        self.marks = []  # (a, b) clock marks around each wait


class Clock:
    """Real time (see the module docstring)."""

    simulated = False

    def __init__(self, streams=None):
        self.streams = streams or HOST  # the run device's (core/streams.py); the host's until for_device
        self._wait_local = threading.local()  # shared by for_device's copies: one run, one count of waits
        self.start = self.now()

    def for_device(self, device: Optional[torch.device]) -> "Clock":
        """This clock (same start) reading time on the run's device: see the module docstring."""
        clock = copy.copy(self)
        clock.streams = streams_for(device)
        return clock

    # ---- reading and spending time --------------------------------------------------------------
    def now(self) -> float:
        self.streams.synchronize()  # a GPU's queued work first (a no-op on the host)
        return self._host_time()

    @staticmethod
    def _host_time() -> float:
        """The host's present, without waiting for the device: the one real-time read."""
        return time.perf_counter()

    def elapsed(self) -> float:
        """Seconds since the run started (the --exit-duration-in-mins budget)."""
        return self.now() - self.start

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    def wait_until(self, t: float) -> float:
        """Let time reach t (a transfer's completion); returns the seconds waited."""
        waited = t - self.now()
        self.sleep(waited)
        return max(waited, 0.0)

    # ---- moments inside a step (dreamddp's profile) ----------------------------------------------
    def mark(self):
        """A moment in this thread's work, compared later by `seconds`. On a GPU an event
        queued on the current stream: it times kernels where they run and waits for nothing."""
        return self.streams.timing_mark() if self.streams.queued else self.now()

    def seconds(self, a, b) -> float:
        """Seconds from mark a to mark b (both complete: see `marks_complete`)."""
        return self.streams.elapsed(a, b) if self.streams.queued else b - a

    def marks_complete(self, marks: Iterable, block: bool) -> bool:
        """Whether the marks can be read (block: wait until they can)."""
        return self.streams.marks_complete(marks, block) if self.streams.queued else True

    # ---- waits for communication (a straggler slows compute, never these) ------------------------
    @contextlib.contextmanager
    def counting_waits(self) -> Iterator["Waits"]:
        """Collects this thread's waits for communication inside the block (`record_wait`);
        `waited_seconds` then sums them. Outside such a block nothing is kept."""
        previous = getattr(self._wait_local, "waits", None)
        waits = self._wait_local.waits = Waits()
        try:
            yield waits
        finally:
            self._wait_local.waits = previous

    def record_wait(self, a, b) -> None:
        """This thread waited for communication from mark a to mark b (an inter-site
        collective's `wait`)."""
        waits = getattr(self._wait_local, "waits", None)
        if waits is not None:
            waits.marks.append((a, b))

    def waited_seconds(self, waits: "Waits") -> float:
        """The seconds of the waits collected: on a GPU the marks are events, read only here
        (after a `now()`, which drains the stream, they are done), so recording cost no sync."""
        self.marks_complete([m for pair in waits.marks for m in pair], block=True)
        return sum(self.seconds(a, b) for a, b in waits.marks)

    # ---- compute charges: the real clock's work took its own time ----------------------------
    def compute(self, microbatches: int, forward_only: bool = False) -> None:
        """`microbatches` forward(+backward) passes of this rank's model chunk were run."""

    @contextlib.contextmanager
    def computing(self, microbatches: int) -> Iterator[None]:
        """The block runs `microbatches` forward+backward passes (charged as `compute` when
        it ends); inside it `backward_done` may report the last micro-batch's progress."""
        yield
        self.compute(microbatches)

    def backward_done(self, share: float) -> None:
        """Inside `computing`: a further `share` (of 1) of this rank's last backward pass has
        completed (a unit's gradients are final). Real time needs no report."""

    def optimizer_step(self) -> None:
        """One inner optimizer step (clip, update, main -> model) was run."""

    def intra_site(self, nbytes: int, ranks: int, site_group, device) -> None:
        """A reduction of `nbytes` per rank over `ranks` ranks inside the site was run (the
        simulated clock also agrees the site's time over `site_group`, on `device`)."""

    def transfer_log(self):
        """Where comm.py books inter-site transfers in virtual time; None: the real clock
        times them by waiting for them."""
        return None

    # ---- work on other threads --------------------------------------------------------------------
    def start_job(self) -> Job:
        # host readings, without waiting for the device: a job's times only say when the host
        # thread started and finished it (the worker's device work is ordered by events)
        return Job(self._host_time())

    @contextlib.contextmanager
    def bound(self, job: Job) -> Iterator[None]:
        """Run the block on `job`'s timeline (this thread), and mark the job finished after it."""
        try:
            yield
        finally:
            job.advance_to(self._host_time())
            job.finish()

    def done_by_now(self, job: Job) -> bool:
        return job.finished

    def join(self, job: Job) -> None:
        """The caller has waited for `job` (its result is in): its present is now at least the job's end."""
