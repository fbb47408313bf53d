"""The run device's streams and events behind one small interface (`streams_for(device)`).

On a GPU, kernels run asynchronously, in order, on the stream they were queued on. Work
handed from one thread's stream to another's (acco/dpu's worker) must be ordered with
events, and a host timer must wait for the work it times. On the host every operation has
finished when its call returns, so `HostStreams` implements the same calls as no-ops: the
code that orders work is the same on both devices, and it runs (and is tested, with a
recording double) on CPU.

- `side_stream()` makes a stream of its own (call it on the thread that will use it);
  `running_on(stream)` makes it the calling thread's current stream for a block.
- `record()` returns an event that completes after the work queued so far on the calling
  thread's current stream; `wait(event)` makes later work on that stream wait for it (the
  host does not wait); `synchronize()` makes the host wait until the calling thread's
  current stream has run everything queued on it (not the other threads' streams).
- `timing_mark()`, `elapsed(a, b)`, `marks_complete(marks, block)`: timing events queued on
  the current stream (the clock's marks on a GPU, core/clock.py).

Only `CudaStreams` touches CUDA; nothing here allocates device memory.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Optional

import torch


class _HostEvent:
    """On the host, work is done when its call returns: every event has completed."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class HostStreams:
    """A CPU run: one implicit stream per thread, always idle (see the module docstring)."""

    queued = False  # operations finish inside their calls

    def side_stream(self) -> object:
        return None

    def running_on(self, stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def record(self) -> _HostEvent:
        return _HostEvent()

    def wait(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def timing_mark(self):
        raise RuntimeError("timing marks are for queued devices; on the host the clock's present is the mark")

    def elapsed(self, a, b) -> float:
        raise RuntimeError("timing marks are for queued devices")

    def marks_complete(self, marks: Iterable, block: bool) -> bool:
        return True


class CudaStreams:
    """One GPU's streams (see the module docstring). Not run by this project's tests: no GPU
    was available (docs/performance.md lists what a GPU run must check)."""

    queued = True

    def __init__(self, device: torch.device):
        self.device = device

    def side_stream(self) -> "torch.cuda.Stream":
        return torch.cuda.Stream(device=self.device)

    def running_on(self, stream) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def record(self) -> "torch.cuda.Event":
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait(self, event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    def timing_mark(self) -> "torch.cuda.Event":
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def elapsed(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3

    def marks_complete(self, marks: Iterable, block: bool) -> bool:
        marks = list(marks)
        if block:
            for m in marks:
                m.synchronize()
            return True
        return all(m.query() for m in marks)


HOST = HostStreams()


def streams_for(device: Optional[torch.device]):
    """The streams of the run's device: CUDA's on a GPU, the host's no-ops otherwise."""
    if device is not None and torch.device(device).type == "cuda":
        return CudaStreams(torch.device(device))
    return HOST
