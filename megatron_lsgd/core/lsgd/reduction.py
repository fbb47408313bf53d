"""Driving a cross-site reduction: a generator that yields one collective handle per phase.

`PendingReduce` holds one in flight: `poll()` advances it without blocking (between inner
steps), `wait()` finishes it (blocking time counts as exposed communication). DiLoCo runs
its reductions blocking (`run_blocking`); DiLoCoX and the streaming algorithms keep them
in flight across inner steps.
"""

from __future__ import annotations

from typing import Generator, Optional

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
