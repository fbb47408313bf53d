"""The simulated inter-site link: delay = latency + bytes * 8 / bandwidth, FIFO, and only
waiting counts as exposed time (single process, fake work handles)."""

import time

import pytest

from megatron_lsgd.core.lsgd.comm import InterSiteComm, SimulatedLink


class Done:
    def is_completed(self):
        return True

    def wait(self):
        pass


def test_transfer_formula():
    link = SimulatedLink(latency_ms=20, bandwidth_mbit=100)
    assert link.transfer_seconds(1_250_000) == pytest.approx(0.02 + 0.1)
    assert SimulatedLink(latency_ms=5).transfer_seconds(10 ** 9) == pytest.approx(0.005)
    assert not SimulatedLink().enabled


def test_wait_takes_the_simulated_time_and_link_is_fifo():
    comm = InterSiteComm(None, 2, SimulatedLink(latency_ms=30, bandwidth_mbit=80))
    t0 = time.perf_counter()
    first = comm._issue(Done(), 500_000, 500_000, phases=1)  # 30 ms + 50 ms
    second = comm._issue(Done(), 500_000, 500_000, phases=1)  # queued behind the first
    assert not first.is_completed()
    first.wait()
    t1 = time.perf_counter() - t0
    second.wait()
    t2 = time.perf_counter() - t0
    assert 0.08 <= t1 < 0.08 + 0.05
    assert 0.16 <= t2 < 0.16 + 0.05
    assert comm.exposed_seconds == pytest.approx(t2, abs=0.01)


def test_overlapped_transfer_is_not_exposed():
    comm = InterSiteComm(None, 2, SimulatedLink(latency_ms=40))
    h = comm._issue(Done(), 10, 10, phases=1)
    time.sleep(0.06)  # "compute"
    assert h.is_completed()
    h.wait()
    assert comm.exposed_seconds < 0.005
