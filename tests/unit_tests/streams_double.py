"""A recording stand-in for the device streams of core/streams.py: behaves as the host (every
operation is done when its call returns) and logs every call with the calling thread, so a
test on CPU can check the order in which code records and waits for events."""

from __future__ import annotations

import contextlib
import threading
from typing import List, Tuple

from megatron_lsgd.core.streams import HostStreams


class RecordedEvent:
    def __init__(self, number: int):
        self.number = number

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class RecordingStreams(HostStreams):
    def __init__(self):
        self.log: List[Tuple] = []  # (thread name, call, argument)
        self._lock = threading.Lock()
        self._count = 0

    def note(self, what: str, arg=None) -> None:
        with self._lock:
            self.log.append((threading.current_thread().name, what, arg))

    def _number(self) -> int:
        with self._lock:
            self._count += 1
            return self._count

    def side_stream(self):
        stream = f"stream{self._number()}"
        self.note("side_stream", stream)
        return stream

    @contextlib.contextmanager
    def running_on(self, stream):
        self.note("enter", stream)
        try:
            yield
        finally:
            self.note("exit", stream)

    def record(self) -> RecordedEvent:
        event = RecordedEvent(self._number())
        self.note("record", event.number)
        return event

    def wait(self, event) -> None:
        self.note("wait", event.number)

    def synchronize(self) -> None:
        self.note("synchronize")
