"""The simulated clock (`--simulate-clock`): the cost and link models' arithmetic on
hand-computed cases, virtual time across threads, a collective that starts at its last
participant's issue time (two spawned ranks), scenario files, and two simulated runs of
every algorithm giving identical logs, timing-driven decisions included."""

from __future__ import annotations

import json
import os
import re
import threading

import pytest
import torch
import torch.distributed as dist

from megatron_lsgd.core.clock import Clock
from megatron_lsgd.core.lsgd.comm import InterSiteComm
from megatron_lsgd.core.simulation import CostModel, LinkFifo, LinkModel, SimulatedClock
from megatron_lsgd.training.scenario import load_scenario
from megatron_lsgd.training.stragglers import Straggler, StragglerConfig
from tests.unit_tests.harness import free_port, run_distributed, run_distributed_many, spawn

SCENARIOS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools", "benchmarks", "scenarios")


class Done:
    """A collective that completed at once in real time (only virtual time matters)."""

    def is_completed(self):
        return True

    def wait(self):
        pass


def sim(microbatch=0.05, optimizer=0.005, rate=0.0, latency=0.0, factor=1.0, pp=1, scale=1.0, sharing=1):
    return SimulatedClock(CostModel(microbatch, optimizer, 0.0, pp, factor),
                          LinkModel(rate, latency, scale, sharing))


# ---- arithmetic ---------------------------------------------------------------------------------
def test_compute_costs():
    c = CostModel(microbatch_seconds=0.05, optimizer_step_seconds=0.01, intra_site_gbit=8.0, pipeline_stages=2)
    assert c.compute_seconds(4) == pytest.approx(0.05 * 5 / 2)  # 1F1B: (n + PP - 1) stage times
    assert c.compute_seconds(4, forward_only=True) == pytest.approx(0.05 * 5 / 2 / 3)
    assert CostModel(0.05, factor=3.0).compute_seconds(2) == pytest.approx(0.3)
    assert c.intra_site_seconds(10 ** 9, 4) == pytest.approx(2 * 3 / 4 * 8e9 / 8e9)  # ring, 8 Gbit/s
    assert c.intra_site_seconds(10 ** 9, 1) == 0.0


def test_a_pass_places_each_units_backward_in_it():
    """The last micro-batch's backward (2/3 of a micro-batch on this stage) ends the pass and
    is spread over the units as they report; the pass still costs what `compute` charges."""
    clock = sim(microbatch=0.3, pp=1)
    with clock.computing(2):  # 0.6 s: the last backward is [0.4, 0.6]
        assert clock.now() == 0.0
        clock.backward_done(0.25)
        assert clock.now() == pytest.approx(0.45)
        clock.backward_done(0.75)
        assert clock.now() == pytest.approx(0.6)
    assert clock.now() == pytest.approx(0.6)
    with clock.computing(1):  # nothing reported: the whole pass at its end, as `compute`
        pass
    assert clock.now() == pytest.approx(0.9)
    clock.backward_done(0.5)  # outside a pass: nothing to place
    assert clock.now() == pytest.approx(0.9)
    real = Clock()
    with real.computing(3):
        real.backward_done(1.0)


def test_dreamddps_profiler_sees_each_units_share_of_the_backward():
    from megatron_lsgd.core.lsgd.algorithms.dreamddp.profile import BackwardRecorder

    clock = sim(microbatch=0.3)
    recorder = BackwardRecorder(["head", "layer"], clock, None)
    recorder.begin_step()
    recorder.marks["<backward start>"] = clock.now()
    with clock.computing(1):
        recorder.marks["<backward start>"] = 0.3 - 0.2  # the last backward starts 0.2 s before the end
        for name, share in (("head", 0.75), ("layer", 0.25)):
            clock.backward_done(share)
            recorder.unit_done(name)
    recorder.wait_reached()
    sample = recorder.sample(block=True)
    assert sample["backward"]["head"] == pytest.approx(0.15)
    assert sample["backward"]["layer"] == pytest.approx(0.05)
    assert sample["tail"] == pytest.approx(0.0)


def test_link_latency_only_rate_only_and_sharing():
    assert LinkModel(latency_ms=20).serialization_seconds(10 ** 9) == 0.0
    assert LinkModel(rate_mbit=100).serialization_seconds(1_250_000) == pytest.approx(0.1)
    assert LinkModel(rate_mbit=100, bytes_scale=2.0).serialization_seconds(1_250_000) == pytest.approx(0.2)
    assert LinkModel(rate_mbit=100, ranks_sharing=4).serialization_seconds(1_250_000) == pytest.approx(0.4)
    fifo = LinkFifo()
    assert fifo.schedule(1.0, 0.0, 0.02) == pytest.approx(1.02)  # latency only


def test_latency_is_charged_per_phase_of_the_collective():
    """A ring all-reduce over S sites is 2 (S - 1) messages in sequence, an all-gather S - 1,
    an all-to-all one exchange; each costs delays_per_phase one-way delays."""
    assert [InterSiteComm(None, s).phases(c) for s in (2, 3, 4) for c in ("all_reduce", "all_gather", "all_to_all")] \
        == [2, 1, 1, 4, 2, 1, 6, 3, 1]
    # the issue's case: 2 sites, 60 ms, gloo after an idle gap (2 delays a phase): a 4 kB
    # all-reduce measured 0.244 s; one latency per collective charged 0.060 s
    assert LinkModel(latency_ms=60, delays_per_phase=2).latency_seconds(2) == pytest.approx(0.24)
    clock = SimulatedClock(CostModel(), LinkModel(rate_mbit=100, latency_ms=10, delays_per_phase=1.5))
    comm = InterSiteComm(None, 3, clock=clock)
    comm._issue(Done(), 1_250_000, 1_250_000, comm.phases("all_reduce")).wait()
    assert clock.now() == pytest.approx(0.1 + 4 * 1.5 * 0.010)  # 0.1 s on the wire + 4 phases x 15 ms
    comm._issue(Done(), 0, 0, comm.phases("all_gather")).wait()
    assert clock.now() == pytest.approx(0.16 + 2 * 0.015)


def test_two_transfers_share_the_fifo():
    clock = sim(rate=100, latency=20)
    comm = InterSiteComm(None, 2, clock=clock)
    first = comm._issue(Done(), 1_250_000, 1_250_000, phases=1)  # 0.1 s on the wire + 20 ms
    second = comm._issue(Done(), 1_250_000, 1_250_000, phases=1)  # leaves the link after the first
    assert not first.is_completed()
    second.wait()
    assert clock.now() == pytest.approx(0.1 + 0.1 + 0.02)
    assert first.is_completed()
    first.wait()  # done already: costs nothing
    assert clock.now() == pytest.approx(0.22)
    assert comm.exposed_seconds == pytest.approx(0.22)


def test_overlap_hidden_by_compute_costs_nothing():
    clock = sim(microbatch=0.5, rate=100, latency=20)
    comm = InterSiteComm(None, 2, clock=clock)
    handle = comm._issue(Done(), 1_250_000, 1_250_000, phases=1)
    clock.compute(1)  # 0.5 s of compute, longer than the 0.12 s transfer
    assert handle.is_completed()
    handle.wait()
    assert clock.now() == pytest.approx(0.5) and comm.exposed_seconds == 0.0
    late = comm._issue(Done(), 1_250_000, 1_250_000, phases=1)
    clock.compute(1)
    clock.optimizer_step()
    late.wait()
    assert clock.now() == pytest.approx(1.005)
    partly = comm._issue(Done(), 2_500_000, 0, phases=1)  # 0.2 s + 20 ms, 0.1 s of it hidden
    clock.advance(0.1)  # compute
    partly.wait()
    assert comm.exposed_seconds == pytest.approx(0.22 - 0.1)


def test_the_cpu_a_transfer_takes_slows_the_compute_after_it_not_the_transfer():
    clock = SimulatedClock(CostModel(0.5, 0.0, 0.0, 1, 1.0), LinkModel(100, 20, 2.0, 1, cpu_seconds_per_mb=0.1))
    comm = InterSiteComm(None, 2, clock=clock)
    handle = comm._issue(Done(), 1_250_000, 1_250_000, phases=1)  # 2.5 MB charged (bytes x 2): 0.25 s of this rank's time
    assert clock.now() == pytest.approx(0.25)
    handle.wait()  # the transfer started at the issue: 0.2 s on the wire + 20 ms, done before the CPU share
    assert clock.now() == pytest.approx(0.25) and comm.exposed_seconds == 0.0
    clock.compute(1)
    assert clock.now() == pytest.approx(0.75)
    assert LinkModel(100, 20).cpu_seconds(10 ** 9) == 0.0  # the default: a NIC moves the bytes


def test_straggler_site_and_straggler_rank_cost_factor_times():
    slow_site = sim(factor=2.0)
    slow_site.compute(3)
    assert slow_site.now() == pytest.approx(0.3)
    clock = sim()
    straggler = Straggler(StragglerConfig(ranks=(1,), factor=3.0), rank=1, clock=clock)
    with straggler.around_compute(0):
        clock.compute(2)
    assert clock.now() == pytest.approx(0.3) and straggler.slept_seconds == pytest.approx(0.2)


def test_a_job_on_another_thread_has_its_own_timeline():
    clock = sim(microbatch=0.25, optimizer=1.0)  # binary fractions: exact sums
    clock.compute(1)
    job = clock.start_job()  # forks at 0.25
    release = threading.Event()

    def worker():
        with clock.bound(job):
            release.wait()
            clock.optimizer_step()  # the job ends at 1.25

    thread = threading.Thread(target=worker)
    thread.start()
    clock.compute(2)  # 0.75: the job has not finished by now
    release.set()
    assert not clock.done_by_now(job)  # decided by virtual time, whatever the real order
    clock.compute(2)  # 1.25
    assert clock.done_by_now(job)
    thread.join()
    clock.join(job)
    assert clock.now() == 1.25


def test_the_real_clock_reads_real_time():
    clock = Clock()
    before = clock.now()
    clock.sleep(0.01)
    assert clock.now() - before >= 0.01 and clock.elapsed() >= 0.01 and not clock.simulated


# ---- a collective starts when its last participant issues it --------------------------------------------
def _last_issuer(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    clock = sim(microbatch=1.0, rate=100, latency=20)
    comm = InterSiteComm(dist.group.WORLD, 2, clock=clock)
    if rank == 1:
        clock.compute(5)  # issues 5 s later
    comm.all_reduce_mean(torch.ones(125_000))  # 500 kB: ring bytes 500 kB, 40 ms + 2 phases x 20 ms
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump({"now": clock.now(), "exposed": comm.exposed_seconds}, f)
    dist.destroy_process_group()


def test_a_collective_starts_at_its_last_participants_issue_time(tmp_path):
    spawn(_last_issuer, args=(free_port(), str(tmp_path)), nprocs=2)
    early, late = (json.load(open(tmp_path / f"{r}.json")) for r in (0, 1))
    assert early["now"] == late["now"] == pytest.approx(5.0 + 0.04 + 0.04)
    assert early["exposed"] == pytest.approx(5.08) and late["exposed"] == pytest.approx(0.08)


# ---- scenarios -------------------------------------------------------------------------------------------
def test_every_shipped_scenario_loads_and_derives_its_numbers():
    names = sorted(n for n in os.listdir(SCENARIOS) if n.endswith(".toml"))
    assert len(names) >= 5
    for name in names:
        s = load_scenario(os.path.join(SCENARIOS, name))
        assert s.sites >= 2 and s.microbatch_seconds > 0 and len(s.rate_mbit) == s.sites, name


def test_a_bad_scenario_names_the_file_and_the_key(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("sites = 2\n[link]\nrate_mbit = [100, 100, 100]\n")
    with pytest.raises(ValueError, match=r"bad.toml \[link\]: rate_mbit has 3 values for 2 sites"):
        load_scenario(str(path))
    path.write_text("sites = 2\n[compute]\nmicrobatch_seconds = -1\n")
    with pytest.raises(ValueError, match="microbatch_seconds = -1"):
        load_scenario(str(path))
    path.write_text("sites = 2\nlinks = 3\n")
    with pytest.raises(ValueError, match="unknown key"):
        load_scenario(str(path))
    path.write_text("sites = 2\n[link]\nrate_mbits = 3\n")  # a typo must not leave the default in force
    with pytest.raises(ValueError, match=r"\[link\]: unknown key\(s\) rate_mbits"):
        load_scenario(str(path))
    path.write_text("sites = 2\n[link]\ncpu_seconds_per_mb = 0.01\n")
    assert load_scenario(str(path)).cpu_seconds_per_mb == 0.01
    path.write_text("sites = 2\n[link]\ndelays_per_phase = 2\n")
    assert load_scenario(str(path)).delays_per_phase == 2.0 and load_scenario(str(path)).latency_ms == [0.0, 0.0]
    path.write_text("sites = 2\n[link]\ndelays_per_phase = -1\n")
    with pytest.raises(ValueError, match=r"\[link\]: delays_per_phase = -1"):
        load_scenario(str(path))


# ---- two simulated runs of every algorithm are identical -----------------------------------------------------
COMMON = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
          "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "5e-3", "--mock-data", "--vocab-size", "250",
          "--make-vocab-size-divisible-by", "32", "--log-interval", "1", "--eval-iters", "0", "--num-sites", "2",
          "--simulate-clock", "--simulate-inter-site-bandwidth", "20", "--simulate-inter-site-latency", "20",
          "--simulate-slow-ranks", "1", "--slow-factor", "2"]
# Each with what its timing decides: dilocox's adaptive H, cocodc's N, dreamddp's profile and
# schedule, acco/dpu's accumulation counts (site 1 is 2x slower), a-edit's meetings.
ALGORITHMS = {
    "sync": ["--train-iters", "4"],
    "diloco": ["--train-iters", "6", "--lsgd-interval", "3"],
    "dilocox": ["--train-iters", "6", "--lsgd-interval", "2", "--lsgd-compression", "int4", "--lsgd-adaptive"],
    "streaming-diloco": ["--train-iters", "8", "--lsgd-interval", "4", "--lsgd-fragments", "2"],
    "cocodc": ["--train-iters", "10", "--lsgd-interval", "4", "--lsgd-fragments", "2"],
    "dreamddp": ["--train-iters", "6", "--lsgd-interval", "2"],
    "dpu": ["--train-iters", "5"],
    "acco": ["--train-iters", "5"],
    "edit": ["--train-iters", "6", "--lsgd-interval", "3"],
    "a-edit": ["--train-samples", "96", "--lsgd-aedit-interval-seconds", "0.5"],
}


def _log(path: str) -> list:
    """The JSON log without the one real-world reading (peak memory), each site's lines in order."""
    with open(path) as f:
        return sorted(re.sub(r'"peak_rss_mb": [0-9.]+, ', "", line) for line in f)


@pytest.mark.slow
def test_two_simulated_runs_of_every_algorithm_are_identical(tmp_path):
    argvs = [COMMON + ["--lsgd-algorithm", name] + args + ["--json-log", str(tmp_path / f"{name}.{rep}.jsonl")]
             for rep in range(2) for name, args in ALGORITHMS.items()]
    # packed here (one spawn): acco whose slow site's micro-batch (4 x 0.05 s) is shorter than
    # an exchange but two of them are longer
    argvs.append(COMMON + ["--lsgd-algorithm", "acco", "--train-iters", "8", "--simulate-microbatch-seconds", "0.05",
                           "--slow-factor", "4"])
    runs = run_distributed_many(argvs, 2)
    fast, slow = (r["sync_stats"]["extra mb"] for r in runs.pop())
    # the slow site starts no micro-batch that would outlast the exchange (it would delay the next
    # one for both sites) once the jobs are measured: extra ones only while the first two jobs ran
    assert slow == 2 and fast > 8, (fast, slow)
    n = len(ALGORITHMS)
    for i, name in enumerate(ALGORITHMS):
        first, second = _log(tmp_path / f"{name}.0.jsonl"), _log(tmp_path / f"{name}.1.jsonl")
        assert first == second, name
        records = [json.loads(line) for line in first]
        assert any(r.get("elapsed_s", 0) > 0 for r in records), name
        for a, b in zip(runs[i], runs[n + i]):
            assert a["comm"] == b["comm"] and a["sync_stats"] == b["sync_stats"], name
            assert a["losses"] == b["losses"], name
    with open(tmp_path / "dreamddp_profile.json") as f:  # the backward is placed unit by unit
        units = json.load(f)["profile"]["units"]
    assert all(u["backward_ms"] > 0 for u in units), units
    acco = runs[list(ALGORITHMS).index("acco")][-1]["sync_stats"]
    assert acco["mb site0"] > acco["mb site1"]  # the fast site accumulated while the slow one computed


def test_simulation_flags_without_the_simulated_clock_are_refused():
    from megatron_lsgd.training.scenario import SimulationOptions

    with pytest.raises(ValueError, match="--simulate-microbatch-seconds only applies with --simulate-clock"):
        SimulationOptions(microbatch_seconds=0.1).validate()
    with pytest.raises(ValueError, match="--simulate-intra-site-bandwidth nan"):
        SimulationOptions(enabled=True, intra_site_gbit=float("nan")).validate()
    with pytest.raises(ValueError, match="--simulate-inter-site-delays-per-phase -2"):
        SimulationOptions(enabled=True, delays_per_phase=-2.0).validate()
    SimulationOptions(enabled=True, microbatch_seconds=0.1).validate()


# ---- sites of different data-parallel sizes ----------------------------------------------------------------
@pytest.mark.slow
def test_sites_of_three_replicas_and_one_on_the_simulated_clock():
    """sync on sites of DP 3 and DP 1 under ZeRO-1, by hand from the run's own bytes, and against
    the equal-sites run it stands for (DP 1 + DP 1: the planner's equivalence). The DP-1 site's
    rank sends all three lanes one after another, each over its site's link shared by
    TP x PP x DP_min = 1 rank (not the 4 // 2 = 2 ranks of an average site: the lanes on a link
    at once are the smallest site's); it steps the scenario's optimizer (the smallest site's),
    the DP-3 site's ranks a third of it (their ZeRO-1 shards). Nothing else waits: intra-site
    reductions are free, no latency, and its partners issue each lane before it does. The two
    runs differ by the bytes the lanes' padding adds, nothing else."""
    mb, opt, rate, steps = 0.25, 0.125, 8.0, 3
    common = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
              "--micro-batch-size", "2", "--train-iters", str(steps), "--lr", "1e-3", "--mock-data",
              "--vocab-size", "96", "--make-vocab-size-divisible-by", "32", "--log-interval", "1", "--eval-iters", "0",
              "--clip-grad", "0", "--use-distributed-optimizer", "--num-sites", "2", "--lsgd-algorithm", "sync",
              "--simulate-clock", "--simulate-microbatch-seconds", str(mb), "--simulate-optimizer-step-seconds",
              str(opt), "--simulate-intra-site-bandwidth", "0", "--simulate-inter-site-bandwidth", str(rate)]
    unequal = run_distributed(common + ["--site-data-parallel-sizes", "3,1", "--global-batch-size", "16"], 4)
    equal = run_distributed(common + ["--global-batch-size", "8"], 2)

    def by_hand(record):  # 2 micro-batches and one optimizer step a step, then the rank's bytes
        return steps * (2 * mb + opt) + record["comm"]["bytes_sent"] * 8 / (rate * 1e6)

    lone, paired = unequal[-1], equal[-1]
    assert lone["coords"].site == 1 and lone["clock_seconds"] == pytest.approx(by_hand(lone), rel=1e-9)
    assert paired["clock_seconds"] == pytest.approx(by_hand(paired), rel=1e-9)
    padding = (lone["comm"]["bytes_sent"] - paired["comm"]["bytes_sent"]) * 8 / (rate * 1e6)
    assert 0 <= padding < 0.01 * paired["clock_seconds"]
    assert lone["clock_seconds"] == pytest.approx(paired["clock_seconds"] + padding, rel=1e-9)
    assert all(r["clock_seconds"] <= lone["clock_seconds"] for r in unequal)  # the lone rank sets the pace
