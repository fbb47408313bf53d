"""Two spawned gloo 'sites': quantized means are bit-identical on both sites and within
the quantization bound of the true mean, byte counts follow the collective used, error
feedback conserves mass across sites, and a peer that disappears gives a clear error."""

from __future__ import annotations

import os
import tempfile
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megatron_lsgd.core.lsgd.comm import InterSiteComm, InterSiteTimeout
from megatron_lsgd.core.lsgd.compressors import build_compressor
from megatron_lsgd.core.lsgd.config import CompressionOptions
from megatron_lsgd.core.lsgd.means import quantized_mean
from megatron_lsgd.core.lsgd.reduction import run_blocking
from megatron_lsgd.core.lsgd.quantization import Quantized
from tests.unit_tests.harness import free_port, spawn


def _init(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)


def _collectives(rank, port, out_dir):
    _init(rank, port)
    comm = InterSiteComm(dist.group.WORLD, 2)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(1000, generator=g)
    record = {}
    for variant in ("allgather", "alltoall"):
        for bits in (4, 8):
            before = comm.bytes_sent
            mean, sent = run_blocking(quantized_mean(comm, x, bits, 64, variant))
            record[(variant, bits)] = (mean, sent, comm.bytes_sent - before)
    # error feedback over several rounds, lowrank-int4 on a (40, 20) matrix + a vector
    shapes = [torch.Size([820])]
    layout = [[((40, 20), 0, 800, 0, 800), ((20,), 0, 20, 800, 820)]]
    red = build_compressor(CompressionOptions("lowrank-int4", 3, 32, "allgather"), comm, shapes, layout, 9,
                           torch.device("cpu"))
    total_in, total_mean = torch.zeros(820, dtype=torch.float64), torch.zeros(820, dtype=torch.float64)
    for _ in range(5):
        d = torch.randn(820, generator=g)
        total_in += d.double()
        total_mean += run_blocking(red.reduce([d]))[0].double()
    record["ef"] = (x, total_in, total_mean, red.errors[0].clone())
    # all-to-all int4: the owner of each chunk feeds its requantization error back too
    red = build_compressor(CompressionOptions("int4", 0, 32, "alltoall"), comm, [torch.Size([300])],
                           [[((300,), 0, 300, 0, 300)]], 9, torch.device("cpu"))
    total_in, total_mean = torch.zeros(300, dtype=torch.float64), torch.zeros(300, dtype=torch.float64)
    for _ in range(5):
        d = torch.randn(300, generator=g)
        total_in += d.double()
        total_mean += run_blocking(red.reduce([d]))[0].double()
    record["ef_a2a"] = (total_in, total_mean, red.errors[0].clone(), red.requant_feedback.residual.clone())
    torch.save(record, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_quantized_means_and_error_feedback_across_two_sites():
    with tempfile.TemporaryDirectory() as d:
        spawn(_collectives, args=(free_port(), d), nprocs=2)
        r0, r1 = (torch.load(os.path.join(d, f"{r}.pt"), weights_only=False) for r in range(2))
    x0, x1 = r0["ef"][0], r1["ef"][0]
    true_mean = (x0 + x1) / 2
    for key in (("allgather", 4), ("allgather", 8), ("alltoall", 4), ("alltoall", 8)):
        (m0, s0, b0), (m1, s1, _b1) = r0[key], r1[key]
        assert torch.equal(m0, m1), key  # bit-identical on both sites
        bits = key[1]
        bound = max(x0.abs().max(), x1.abs().max()) / (2 * (127 if bits == 8 else 7))
        factor = 1 if key[0] == "allgather" else 2  # alltoall requantizes the mean
        assert (m0 - true_mean).abs().max() <= factor * bound + 1e-6, key
        payload = Quantized.nbytes(1000, bits, 64)
        if key[0] == "allgather":
            assert b0 == payload  # (S-1) x payload
            assert torch.equal(m0, (s0 + s1) / 2)
        else:
            chunk = Quantized.nbytes(512, bits, 64)  # 1000 values padded to 2 chunks of 8 blocks
            assert b0 == chunk + chunk  # all-to-all half of 2 chunks + all-gather of 1 chunk
    # mass: sum of means x S + both residuals = sum of both sites' inputs
    _, in0, mean0, e0 = r0["ef"]
    _, in1, mean1, e1 = r1["ef"]
    assert torch.equal(mean0, mean1)
    torch.testing.assert_close(2 * mean0 + e0.double() + e1.double(), in0 + in1, rtol=0, atol=1e-4)
    # all-to-all: ... + the owners' requantization residuals (chunk i lives on site i)
    in0, mean0, e0, q0 = r0["ef_a2a"]
    in1, mean1, e1, q1 = r1["ef_a2a"]
    assert torch.equal(mean0, mean1) and q0.numel() == q1.numel() == 160  # 300 values, 2 chunks of 5 blocks
    owners = torch.cat([q0, q1])[:300].double()
    torch.testing.assert_close(2 * mean0 + e0.double() + e1.double() + 2 * owners, in0 + in1, rtol=0, atol=1e-4)
    assert owners.abs().max() > 0


def _vanishing_peer(rank, port, out_dir):
    _init(rank, port)
    group = dist.new_group([0, 1], timeout=timedelta(seconds=2))
    if rank == 1:
        time.sleep(4)  # never joins the collective: the site has "disappeared"
        os._exit(0)
    comm = InterSiteComm(group, 2, timeout_minutes=0.05)
    t0 = time.perf_counter()
    try:
        comm.all_reduce_mean(torch.ones(10))
        message = "no error"
    except InterSiteTimeout as err:
        message = str(err)
    with open(os.path.join(out_dir, "msg"), "w") as f:
        f.write(f"{time.perf_counter() - t0:.1f}|{message}")
    os._exit(0)


@pytest.mark.slow
def test_a_peer_site_that_disappears_gives_a_clear_timeout():
    with tempfile.TemporaryDirectory() as d:
        spawn(_vanishing_peer, args=(free_port(), d), nprocs=2)
        seconds, message = open(os.path.join(d, "msg")).read().split("|", 1)
    assert "--distributed-timeout-minutes" in message and "peer site" in message
    assert float(seconds) < 4


def test_polling_and_waiting_over_a_real_link_read_no_clock():
    # On a GPU a clock reading waits for the compute stream (core/clock.py): polling or waiting
    # for a transfer with no simulated link reads none, and the wait's exposed time is timed
    # with marks (events on the stream).
    from megatron_lsgd.core.clock import Clock
    from megatron_lsgd.core.lsgd.comm import InterSiteWork
    from tests.unit_tests.streams_double import RecordedEvent, RecordingStreams

    class Queued(RecordingStreams):
        queued = True

        def timing_mark(self):
            self.note("mark")
            return RecordedEvent(self._number())

        def elapsed(self, a, b):
            return 0.25

        def marks_complete(self, marks, block):
            return True

    class Done:
        def is_completed(self):
            return True

        def wait(self):
            pass

    streams = Queued()
    comm = InterSiteComm(None, 2, clock=Clock(streams))
    streams.log.clear()
    work = InterSiteWork(comm, Done())
    assert work.is_completed()
    work.wait()
    assert [what for _, what, _ in streams.log] == ["mark", "mark"] and comm.exposed_seconds == 0.25
    linked = InterSiteWork(comm, Done(), ready_at=1e12)  # a simulated link's completion: the clock decides
    assert not linked.is_completed() and streams.log[-1][1] == "synchronize"


@pytest.mark.parametrize("minutes,timeout", [(7, timedelta(minutes=7)), (None, None)])
def test_dedicated_groups_take_the_comms_timeout(monkeypatch, minutes, timeout):
    # Every algorithm with reductions of its own (edit, acco, dreamddp, dilocox, streaming) takes
    # its dp_inter groups through use_dedicated_group: the comm's --distributed-timeout-minutes
    # reaches each new group, in dp_inter's order (the same on every rank).
    from megatron_lsgd.core.parallel_state import ParallelDims, enumerate_group_ranks

    made = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_backend", lambda group: "gloo")
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: made.append((tuple(ranks), kw)) or len(made))
    dims = ParallelDims(tp=2, pp=1, dp_intra=1, sites=2)
    comm = InterSiteComm("shared", 2, timeout_minutes=minutes)
    assert comm.group_timeout() == timeout
    mine = comm.use_dedicated_group(dims)
    assert [ranks for ranks, _ in made] == enumerate_group_ranks(dims)["dp_inter"]
    assert all(kw.get("timeout") == timeout and kw["backend"] == "gloo" for _, kw in made)
    assert ("timeout" in made[0][1]) == (timeout is not None)
    assert mine == [i + 1 for i, (ranks, _) in enumerate(made) if 1 in ranks] and comm.group == mine[0]
