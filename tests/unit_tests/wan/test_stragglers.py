"""--simulate-slow-ranks: who is slowed, by how much, reproducibly, without changing the numbers."""

import json
import os
import time

import pytest

from megatron_lsgd.core.clock import Clock
from megatron_lsgd.core.lsgd.comm import InterSiteComm, InterSiteWork
from megatron_lsgd.core.simulation import CostModel, LinkModel, SimulatedClock
from megatron_lsgd.training.arguments import build_config, parse_args
from megatron_lsgd.training.stragglers import Straggler, StragglerConfig, parse_rank_list
from tests.unit_tests.harness import logged_losses, run_distributed

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3", "--mock-data", "--vocab-size", "128",
        "--eval-iters", "0", "--log-interval", "2", "--hidden-dropout", "0", "--attention-dropout", "0"]


def test_parse_rank_list():
    assert parse_rank_list("3,1, 3") == (1, 3)
    assert parse_rank_list("") == () and parse_rank_list(None) == ()
    with pytest.raises(ValueError, match="--simulate-slow-ranks 'a,1'"):
        parse_rank_list("a,1")


@pytest.mark.parametrize("extra,world,message", [
    (["--simulate-slow-ranks", "4"], 4, "--simulate-slow-ranks 4: ranks must be in 0..3"),
    (["--simulate-slow-ranks", "0", "--slow-factor", "0.5"], 1, "--slow-factor 0.5 must be >= 1"),
    (["--simulate-slow-ranks", "0", "--slow-probability", "1.5"], 1, "--slow-probability 1.5"),
])
def test_bad_flags_name_the_flag(extra, world, message):
    with pytest.raises(ValueError, match=message):
        build_config(parse_args(BASE + extra), world)


class FakeSleep(Clock):
    """The real clock, but its sleeps are recorded instead of slept."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def sleep(self, seconds):
        self.calls.append(seconds)


def test_consistent_sleeps_factor_minus_one_times_compute():
    sleep = FakeSleep()
    s = Straggler(StragglerConfig(ranks=(1,), factor=3.0), rank=1, clock=sleep)
    for it in range(3):
        with s.around_compute(it):
            time.sleep(0.02)
    assert len(sleep.calls) == 3
    for d in sleep.calls:  # 2 x the measured 20 ms (timer granularity and load only add)
        assert 0.04 <= d < 0.2
    assert s.slept_seconds == pytest.approx(sum(sleep.calls))


def test_unchosen_rank_and_factor_one_never_sleep():
    sleep = FakeSleep()
    for s in (Straggler(StragglerConfig(ranks=(1,), factor=3.0), rank=0, clock=sleep),
              Straggler(StragglerConfig(ranks=(0,), factor=1.0), rank=0, clock=sleep)):
        with s.around_compute(0):
            time.sleep(0.001)
        assert not s.is_slow(0)
    assert sleep.calls == []


class _Done:
    """A collective that has already completed (the simulated link sets when it ends)."""

    def wait(self):
        pass


def test_waits_for_communication_are_not_slowed():
    """Inside the block: 0.3 s of compute, then a wait for a collective whose 100 ms latency
    has not passed (EDiT's unit sync in the forward pass). Factor 2 sleeps 0.3 s, not 0.4."""
    clock = SimulatedClock(CostModel(microbatch_seconds=0.3), LinkModel(latency_ms=100.0))
    comm = InterSiteComm(None, num_sites=2, clock=clock)
    s = Straggler(StragglerConfig(ranks=(0,), factor=2.0), rank=0, clock=clock)
    with s.around_compute(0):
        with clock.computing(1):
            pass  # charges 0.3 s when it ends
        transfer = clock.transfer_log().issue(clock, 0, None, None)  # issued at 0.3 s, done at 0.3 + latency
        InterSiteWork(comm, _Done(), transfer=transfer).wait()
        assert clock.now() == pytest.approx(0.4)
    assert s.slept_seconds == pytest.approx(0.3)
    assert clock.now() == pytest.approx(0.7)
    assert comm.snapshot()["exposed_seconds"] == pytest.approx(0.1)  # the wait is still exposed communication


def test_random_mode_is_seeded_and_has_the_asked_rate():
    cfg = StragglerConfig(ranks=(0, 1), factor=2.0, mode="random", probability=0.3, seed=7)
    a = [Straggler(cfg, 0, Clock()).is_slow(i) for i in range(2000)]
    assert a == [Straggler(cfg, 0, Clock()).is_slow(i) for i in range(2000)]  # same on every run
    assert 0.25 < sum(a) / len(a) < 0.35
    b = [Straggler(cfg, 1, Clock()).is_slow(i) for i in range(2000)]
    assert a != b  # ranks lag independently
    other_seed = StragglerConfig(ranks=(0, 1), factor=2.0, mode="random", probability=0.3, seed=8)
    assert a != [Straggler(other_seed, 0, Clock()).is_slow(i) for i in range(2000)]


@pytest.mark.slow
def test_slow_rank_sleeps_and_changes_no_number(tmp_path):
    """Two sites, rank 1 (the logging rank) 3x slower: same losses, sleep recorded in the JSON log."""
    argv = BASE + ["--num-sites", "2"]
    plain = logged_losses(run_distributed(argv, 2))
    log = os.path.join(tmp_path, "log.jsonl")
    slow = logged_losses(run_distributed(argv + ["--simulate-slow-ranks", "1", "--slow-factor", "3",
                                                 "--json-log", log], 2))
    assert slow == plain
    records = [json.loads(line) for line in open(log)]
    intervals, done = records[:-1], records[-1]
    assert [r["iteration"] for r in intervals] == [2, 4]
    assert [r["losses"]["lm loss"] for r in intervals] == pytest.approx(plain)
    assert all(r["inter_site_bytes"] > 0 and r["tokens"] == 2 * 4 * 16 for r in intervals)
    assert done["event"] == "done" and done["peak_rss_mb"] > 0 and done["straggler_sleep_s"] > 0


@pytest.mark.slow
def test_layerwise_sync_waits_are_not_slowed(tmp_path):
    """EDiT syncs layer by layer in the forward pass, inside the straggler's block. On the
    simulated clock (0.1 s per micro-batch, one per step, 50 ms links) rank 1, 3x slow,
    sleeps exactly 2 x 0.1 s per step: 4 steps, 0.8 s; its waits for the unit syncs are not
    slowed (they were: the sleep then exceeded 0.8 s)."""
    log = os.path.join(tmp_path, "log.jsonl")
    run_distributed(BASE + ["--num-sites", "2", "--lsgd-algorithm", "edit", "--lsgd-interval", "2",
                            "--simulate-clock", "--simulate-microbatch-seconds", "0.1",
                            "--simulate-inter-site-latency", "50", "--simulate-slow-ranks", "1", "--slow-factor", "3",
                            "--json-log", log], 2)
    records = [json.loads(line) for line in open(log)]
    assert records[-1]["straggler_sleep_s"] == pytest.approx(0.8)
    assert records[-2]["inter_site_bytes"] > 0  # the units did sync
