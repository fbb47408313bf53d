"""The run's clock on a device (core/clock.py, core/streams.py): a real clock reads time only
after the calling thread's queued device work has run, a simulated clock never waits for a
device, marks inside a step are events on a queued device and the present on the host, and
the host's stream calls are no-ops (the CPU readings are plain perf_counter)."""

from __future__ import annotations

import threading
import time

import torch

from megatron_lsgd.core.clock import Clock
from megatron_lsgd.core.simulation import CostModel, LinkModel, SimulatedClock
from megatron_lsgd.core.streams import HOST, CudaStreams, HostStreams, streams_for
from tests.unit_tests.streams_double import RecordingStreams

ME = threading.current_thread().name


def test_a_real_clock_waits_for_this_threads_stream_before_every_reading():
    streams = RecordingStreams()
    clock = Clock(streams)
    streams.log.clear()
    before = time.perf_counter()
    t = clock.now()
    assert streams.log == [(ME, "synchronize", None)] and t >= before
    clock.elapsed()
    clock.wait_until(0.0)  # a transfer that completed long ago: still a reading
    assert [c for _, c, _ in streams.log] == ["synchronize"] * 3
    clock.sleep(0.0)
    clock.start_job()  # the real clock never reads a job's time: nothing to wait for
    assert len(streams.log) == 3


def test_the_clock_takes_the_runs_device_and_keeps_its_start():
    clock = Clock()
    assert clock.streams is HOST
    on_gpu = clock.for_device(torch.device("cuda", 0))  # only declared: nothing touches CUDA
    assert isinstance(on_gpu.streams, CudaStreams) and on_gpu.streams.device == torch.device("cuda", 0)
    assert on_gpu.start == clock.start and clock.streams is HOST  # a copy: the host clock is unchanged
    assert clock.for_device(torch.device("cpu")).streams is HOST and streams_for(None) is HOST


def test_the_host_streams_are_no_ops():
    host = HostStreams()
    with host.running_on(host.side_stream()):
        event = host.record()
        host.wait(event)
        host.synchronize()
    assert event.query() and host.marks_complete([event], block=False)


def test_a_simulated_clock_never_waits_for_the_device():
    streams = RecordingStreams()
    clock = SimulatedClock(CostModel(microbatch_seconds=0.5), LinkModel(), streams)
    clock.compute(2)
    a = clock.mark()
    clock.compute(2)
    b = clock.mark()
    assert clock.now() == 2.0 and clock.seconds(a, b) == 1.0 and clock.marks_complete([a, b], block=False)
    assert clock.streams is streams and streams.log == []


class _QueuedDouble(RecordingStreams):
    """A device whose work is queued: marks are timing events (here: stamped at creation)."""

    queued = True

    def timing_mark(self):
        self.note("timing_mark")
        return time.perf_counter()

    def elapsed(self, a, b):
        self.note("elapsed")
        return b - a

    def marks_complete(self, marks, block):
        self.note("marks_complete", block)
        return block  # just queued: complete only once waited for


def test_marks_on_a_queued_device_are_events_read_without_waiting():
    streams = _QueuedDouble()
    clock = Clock(streams)
    streams.log.clear()
    a, b = clock.mark(), clock.mark()
    assert clock.marks_complete([a, b], block=True) and clock.seconds(a, b) >= 0
    assert [c for _, c, _ in streams.log] == ["timing_mark", "timing_mark", "marks_complete", "elapsed"]
    # on the host a mark is the present
    host = Clock()
    m = host.mark()
    assert isinstance(m, float) and host.seconds(m, m + 1.5) == 1.5 and host.marks_complete([m], block=False)


def test_exposed_time_between_marks_is_read_without_a_device_sync_and_settled_at_the_snapshot():
    from megatron_lsgd.core.lsgd.comm import InterSiteComm

    streams = _QueuedDouble()
    comm = InterSiteComm(None, 2, clock=Clock(streams))
    a = comm.clock.mark()
    b = a + 0.25  # (the double's marks are host times)
    streams.log.clear()
    comm.record_exposed_between(a, b)
    assert comm.exposed_seconds == 0.0 and (ME, "synchronize", None) not in streams.log
    assert comm.snapshot()["exposed_seconds"] == 0.25 and comm.snapshot()["exposed_seconds"] == 0.25
    assert (ME, "marks_complete", True) in streams.log
    host = InterSiteComm(None, 2)  # on the host a mark is the present: counted at once
    host.record_exposed_between(1.0, 1.5)
    assert host.exposed_seconds == 0.5
