"""Driving a cross-site reduction: a generator that yields one collective handle per phase.

`PendingReduce` holds one in flight: `poll()` advances it without blocking (between inner
steps), `wait()` finishes it (blocking time counts as exposed communication). DiLoCo runs
its reductions blocking (`run_blocking`); DiLoCoX keeps one in flight across inner steps;
`ReductionQueue` keeps several in flight (the streaming algorithms' fragments) while every
site still issues the same sequence of collectives.
"""

from __future__ import annotations

from typing import Generator, List, Optional

from megatron_lsgd.core.clock import Clock
from megatron_lsgd.core.lsgd.comm import InterSiteWork

Reduction = Generator[InterSiteWork, None, object]


class PendingReduce:
    """A reduction in flight: `poll()` advances it without blocking (between inner steps),
    `wait()` finishes it (blocking time counts as exposed communication)."""

    def __init__(self, gen: Reduction):
        self._gen = gen
        self._handle: Optional[InterSiteWork] = None
        self.result = None
        self.done = False
        self._step()  # issue the first collective now

    @classmethod
    def finished(cls, result) -> "PendingReduce":
        """An already finished reduction (e.g. restored from a checkpoint)."""
        pending = cls.__new__(cls)
        pending._gen, pending._handle, pending.result, pending.done = None, None, result, True
        return pending

    def _step(self) -> None:
        try:
            self._handle = next(self._gen) if self._handle is None else self._gen.send(None)
        except StopIteration as stop:
            self.result, self.done, self._handle = stop.value, True, None

    def poll(self) -> bool:
        while not self.done and self._handle.is_completed():
            self._handle.wait()  # already complete: costs nothing, moves accounting along
            self._step()
        return self.done

    def wait(self):
        while not self.done:
            self._handle.wait()
            self._step()
        return self.result


def run_blocking(gen: Reduction):
    return PendingReduce(gen).wait()


class QueuedReduce:
    """One reduction of a `ReductionQueue`: `done`/`result` as PendingReduce's; `issued_at` and
    `finished_at` (perf_counter) say when its first collective went out and when it was seen
    complete (at a poll or a wait, so at most one poll interval late); `bytes_sent` is what
    its collectives put on this rank's link (when the queue has a comm to count with)."""

    def __init__(self, gen: Optional[Reduction]):
        self._gen = gen
        self._handle: Optional[InterSiteWork] = None
        self.started = False
        self.result = None
        self.done = False
        self.issued_at: Optional[float] = None
        self.finished_at: Optional[float] = None
        self.bytes_sent = 0

    @classmethod
    def finished(cls, result) -> "QueuedReduce":
        """An already finished reduction (e.g. restored from a checkpoint)."""
        item = cls(None)
        item.started = item.done = True
        item.result = result
        return item

    @property
    def seconds(self) -> Optional[float]:
        """Issue to observed completion (None unless this process ran it)."""
        if self.issued_at is None or self.finished_at is None:
            return None
        return self.finished_at - self.issued_at


class ReductionQueue:
    """Reductions in flight one after another, in submission order.

    Several reductions may be outstanding at once (Streaming DiLoCo / CoCoDC keep a few
    fragments in flight), but a reduction with several phases issues its next collective
    only when its previous one is seen complete, and when that happens depends on timing.
    If two were advanced side by side, sites could issue their collectives in different
    orders and match the wrong ones. Here only the oldest unfinished reduction advances; the
    next one's first collective is issued when it finishes. Every site therefore issues the
    same sequence of collectives, whatever the timing, and a FIFO link loses nothing by it.

    `submit` starts a reduction at once when nothing is ahead of it; `poll()` advances
    without blocking (call it between inner steps); `wait(item)` finishes everything up to
    and including `item` (blocking time counts as exposed communication)."""

    def __init__(self, comm=None):
        self._comm = comm  # optional: counts each reduction's bytes, and its clock times them
        self._clock = comm.clock if comm is not None else Clock()
        self._items: List[QueuedReduce] = []

    def __len__(self) -> int:
        return len(self._items)

    def submit(self, gen: Reduction) -> QueuedReduce:
        item = QueuedReduce(gen)
        self._items.append(item)
        if len(self._items) == 1:
            self._advance(item)
            self._retire_finished_head()
        return item

    def _advance(self, item: QueuedReduce) -> None:
        """Issue the item's next collective (its first one if it has not started)."""
        before = self._comm.bytes_sent if self._comm is not None else 0
        try:
            if not item.started:
                item.started = True
                item.issued_at = self._clock.now()
                item._handle = next(item._gen)
            else:
                item._handle = item._gen.send(None)
        except StopIteration as stop:
            item.result, item.done, item._handle = stop.value, True, None
            item.finished_at = self._clock.now()
        if self._comm is not None:
            item.bytes_sent += self._comm.bytes_sent - before

    def _retire_finished_head(self) -> None:
        while self._items and self._items[0].done:
            self._items.pop(0)
            if self._items and not self._items[0].started:
                self._advance(self._items[0])

    def poll(self) -> None:
        while self._items:
            head = self._items[0]
            if not head.done:
                if not head._handle.is_completed():
                    return
                head._handle.wait()  # complete: costs nothing, moves accounting along
                self._advance(head)
            self._retire_finished_head()

    def wait(self, item: QueuedReduce):
        while not item.done:
            head = self._items[0]
            head._handle.wait()
            self._advance(head)
            self._retire_finished_head()
        return item.result

    def clear(self) -> None:
        """Forget every reduction (one failed: the collectives behind it will not match)."""
        self._items.clear()

    def drain(self) -> None:
        """Finish every reduction in flight."""
        if self._items:
            self.wait(self._items[-1])
