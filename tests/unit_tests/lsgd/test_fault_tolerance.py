"""Elastic sites on torchft (--lsgd-fault-tolerance torchft, docs/fault_tolerance.md).

The multi-site tests run each site as its own process (tools/benchmarks/elastic/ft_site.py: the
real diloco synchronizer, TorchftMembership and ElasticComm; a toy inner step whose
updates are dyadic, so two-site means are exact and rounds can be replayed here), with a
torchft lighthouse in the test process. Sites are killed with SIGKILL mid-round and
restarted as fresh processes, as torchrun --max-restarts would.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from types import SimpleNamespace

import pytest
import torch

from megatron_lsgd.core.lsgd.config import OuterOptions
from megatron_lsgd.core.lsgd.fault_tolerance.options import FaultToleranceOptions
from megatron_lsgd.core.lsgd.outer_state import OuterState
from tests.unit_tests.lsgd.fakes import scripted_membership

os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse (in this process) logs every quorum at info
# The multi-site tests need torchft (pip install -e ".[ft]"); the option checks do not.
needs_torchft = pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="torchft is not installed")

from tools.benchmarks.elastic.ft_site import (FlatOptimizer, SiteSpec, initial_params, inner_update, launch, read_log, starts,  # noqa: E402
                                      start_lighthouse, wait_started)


# ---- the reference: a round replayed in this process ---------------------------------------------
def inner_momentum(site: int, steps: int, start: torch.Tensor = None, first: int = 0) -> torch.Tensor:
    """A site's inner momentum before step `steps` (it does not depend on the parameters)."""
    m = torch.zeros(8) if start is None else start.clone()
    for k in range(first, steps):
        m.mul_(0.5).add_(inner_update(site, k))
    return m


def replay_round(anchor, momentum, sites, first_step, interval, momenta_at_first):
    """One committed round over `sites` (exact for 1 or 2 sites): returns (anchor, outer momentum)."""
    outer = OuterState([torch.tensor(anchor)], OuterOptions(lr=0.5, momentum=0.5))
    outer.load_state_dict({"anchors": [torch.tensor(anchor)], "momentum": [torch.tensor(m) for m in momentum],
                           "momentum_started": ["all"] if momentum else []})
    deltas = []
    for site in sites:
        local, m = torch.tensor(anchor), momenta_at_first[site].clone()
        for k in range(first_step, first_step + interval):
            m.mul_(0.5).add_(inner_update(site, k))
            local.add_(m)
        views = FlatOptimizer(local).views()
        deltas.append(outer.pseudo_gradient(views)[0] * (1.0 / len(sites)))
    mean = deltas[0] if len(deltas) == 1 else deltas[0] + deltas[1]
    outer.step(FlatOptimizer(torch.tensor(anchor)).views(), [mean])
    return outer.anchors[0].tolist(), [m.tolist() for m in outer.momenta]


def rounds(records):
    return [r for r in records if "round" in r]


def logs(records):
    return [r["log"] for r in records if "log" in r]


def by_round(records):
    """committed-round count -> digest, over the records of committed rounds."""
    return {r["round"]: r["digest"] for r in rounds(records)}


def _run(tmp_path, num_sites, min_sites, steps, kills=None, restart=False, compression="none", lighthouse=True,
         step_seconds=0.05, lighthouse_min=None, timeout_s=180, site_timeout_s=5.0):
    """Run the sites to the end; with `restart`, a killed site is started again (a fresh
    process) while the others are held before their next inner step until it is up.
    Returns every site's records and last exit codes."""
    import time

    out = str(tmp_path)
    os.makedirs(out, exist_ok=True)
    kills = kills or {}
    lh = start_lighthouse(lighthouse_min or min_sites) if lighthouse else None
    go, pause = os.path.join(out, "go"), os.path.join(out, "pause")
    port = 0
    if not lighthouse:
        from megatron_lsgd.training.initialize import free_port

        port = free_port()

    def spec(site, kill=None):
        return SiteSpec(site=site, num_sites=num_sites, steps=steps, interval=2, out_dir=out,
                        lighthouse=lh.address() if lh else "", min_sites=min_sites, compression=compression,
                        step_seconds=step_seconds, kill_at_step=kill, go_file=go, pause_file=pause, world_port=port,
                        timeout_s=site_timeout_s)

    procs = {}
    try:
        procs.update({s: launch(spec(s, kills.get(s))) for s in range(num_sites)})
        wait_started(out, procs)
        open(go, "w").close()
        deadline = time.time() + timeout_s
        restarted = set()
        while [p.poll() for p in list(procs.values())].count(None):  # poll every one (sets returncode)
            assert time.time() < deadline, f"the job did not finish in {timeout_s} s ({out})"
            for s, p in list(procs.items()):
                if restart and p.returncode == -9 and s not in restarted:
                    open(pause, "w").close()
                    procs[s] = launch(spec(s))
                    wait_started(out, [s], times=2)
                    os.remove(pause)
                    restarted.add(s)
            time.sleep(0.05)
        return [read_log(out, s) for s in range(num_sites)], {s: p.returncode for s, p in procs.items()}
    finally:
        for p in procs.values():  # a failed test leaves no site behind
            if p.poll() is None:
                p.kill()
        if lh is not None:
            lh.shutdown()


@needs_torchft
@pytest.mark.slow
def test_a_site_killed_mid_round_is_rolled_back_then_heals(tmp_path):
    # 3 sites, H = 2, floor 2: site 2 dies after step 5, in the middle of the round of
    # steps 4-5 (committed rounds so far: 2), and is restarted fresh a moment later.
    records, codes = _run(tmp_path, num_sites=3, min_sites=2, steps=16, kills={2: 5}, restart=True)
    s0, s1, s2 = records
    assert codes == {0: 0, 1: 0, 2: 0}

    # Survivors: the round in flight was not committed, one line names the lost site.
    for survivor in (s0, s1):
        lost = [line for line in logs(survivor) if "not committed" in line]
        assert len(lost) == 1 and "lost site 2" in lost[0], logs(survivor)
        r = rounds(survivor)
        assert [x["round"] for x in r[:3]] == [1, 2, 2]  # round 3 attempted, not kept
        assert r[2]["digest"] == r[1]["digest"]  # the anchor stayed

    # ... and continue as if that round never happened: the next committed round is the
    # two survivors' round of steps 6-7 from the round-2 anchor and outer momentum.
    r0 = rounds(s0)
    assert r0[3]["round"] == 3 and r0[3]["step"] == 8
    momenta = {s: inner_momentum(s, 6) for s in (0, 1)}
    anchor, momentum = replay_round(r0[1]["anchor"], r0[1]["momentum"], (0, 1), 6, 2, momenta)
    assert r0[3]["anchor"] == anchor and r0[3]["momentum"] == momentum
    assert rounds(s1)[3]["digest"] == r0[3]["digest"]

    # The restarted site was healed from a live peer and agrees at every round after.
    restarted = starts(s2)[1]
    assert any("rejoined" in line for line in logs(s2[restarted:]))
    after = by_round(s2[restarted:])
    assert after, "the restarted site committed no round"
    for other in (s0, s1):
        digests = by_round(other)
        assert all(digests[k] == d for k, d in after.items())
    # Every site's anchors agree at every committed round.
    assert by_round(s0) == by_round(s1)
    assert max(after) == max(by_round(s0))


def quorums(records):
    return [r for r in records if r.get("ft") == "quorum"]


@needs_torchft
@pytest.mark.slow
def test_a_lone_site_says_so_within_seconds_then_stops_with_one_error(tmp_path):
    # A site that comes first (or after every other has left), under a lighthouse that forms
    # no quorum of one site (tools/wan/launch.py's: --min_replicas = --lsgd-min-sites 2). Its
    # lines come every log_every (pretrain_gpt.py's 10 s; 60 here), but the first within seconds;
    # after --lsgd-ft-max-wait torchft's quorum times out and the site stops with one error line.
    lh = start_lighthouse(2)
    try:
        site = launch(SiteSpec(site=0, num_sites=2, steps=8, out_dir=str(tmp_path), lighthouse=lh.address(),
                               min_sites=2, max_wait_s=6.0, log_every=60.0))
        code = site.wait(timeout=120)
    finally:
        lh.shutdown()
    records = read_log(str(tmp_path), 0)
    started = records[starts(records)[0]]["t"]
    waits = [r for r in records if "waits for --lsgd-min-sites 2 sites" in r.get("log", "")]
    assert waits and waits[0]["t"] - started < 5.0, records
    assert "no quorum yet); sites of the last round: none; stops at --lsgd-ft-max-wait 6 s" in waits[0]["log"]
    errors = [r["error"] for r in records if "error" in r]
    assert code == 2 and len(errors) == 1 and errors[0].startswith(
        "site 0: no quorum in --lsgd-ft-max-wait 6 s (the lighthouse formed none with this site"), records
    assert not rounds(records)


@needs_torchft
@pytest.mark.slow
def test_a_lone_site_trains_alone_then_rejoins_the_others_quorum(tmp_path):
    # 2 sites, floor 2, --lsgd-ft-lone-site train, a lighthouse that forms a quorum of one:
    # site 0 comes alone, waits --lsgd-ft-max-wait (3 s), then trains alone, its rounds
    # committed with itself as the only member (exactly a one-site round). Site 1 then comes
    # fresh: the two meet in one quorum, site 1 is healed from site 0, and they train together.
    import time

    out = str(tmp_path)
    go, pause = os.path.join(out, "go"), os.path.join(out, "pause")
    open(go, "w").close()
    lh = start_lighthouse(1)

    def spec(site):
        return SiteSpec(site=site, num_sites=2, steps=40, interval=2, out_dir=out, lighthouse=lh.address(),
                        min_sites=2, max_wait_s=3.0, lone_site="train", step_seconds=0.05, go_file=go,
                        pause_file=pause)

    procs = {0: launch(spec(0))}
    try:
        deadline = time.time() + 120
        while len(rounds(read_log(out, 0))) < 2:  # two rounds alone, then site 1 comes
            assert procs[0].poll() is None and time.time() < deadline, read_log(out, 0)
            time.sleep(0.05)
        open(pause, "w").close()  # site 0 holds before its next step while site 1 starts
        procs[1] = launch(spec(1))
        wait_started(out, [1])
        os.remove(pause)
        codes = {s: p.wait(timeout=120) for s, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        lh.shutdown()
    s0, s1 = read_log(out, 0), read_log(out, 1)
    assert codes == {0: 0, 1: 0}, (s0, s1)
    alone = [i for i, r in enumerate(s0) if r.get("log", "").startswith("site 0 trains alone")]
    assert len(alone) == 1, logs(s0)
    # its first round, alone, committed: the replay of one site's round from the initial weights
    first = rounds(s0)[0]
    assert (first["round"], first["step"], first["committed"]) == (1, 2, 1)
    anchor, momentum = replay_round(initial_params().tolist(), [], (0,), 0, 2, {0: torch.zeros(8)})
    assert first["anchor"] == anchor and first["momentum"] == momentum
    met = [q for q in quorums(s0) if q["sites"] == [0, 1]]
    assert met and all(q["sites"] == [0] for q in quorums(s0) if q["t"] < met[0]["t"])
    joined = met[0]["committed"]
    assert joined >= 2 and [r["round"] for r in rounds(s0) if r["t"] < met[0]["t"]] == list(range(1, joined + 1))
    assert any(line.startswith("site 0 no longer trains alone: sites now 0,1") for line in logs(s0)), logs(s0)
    # site 1 was healed to site 0's state at that quorum and agrees with it at every later round
    assert sum(line.startswith(f"site 1 rejoined at committed round {joined}") for line in logs(s1)) == 1, logs(s1)
    after = by_round(s1)
    assert after and min(after) == joined + 1 and all(by_round(s0)[k] == d for k, d in after.items())


@needs_torchft
@pytest.mark.slow
def test_one_heal_per_fault_every_survivor_meets_the_restarted_site(tmp_path):
    # 3 sites in a ring, floor 2: site 0 dies mid-round (after step 5). Its ring neighbour
    # learns at once; the other survivor waits on that live neighbour, which stops sending.
    # Were it left to its --lsgd-ft-timeout (20 s here, far longer than a restart), the
    # restarted site's first quorum would hold it and one survivor only (the lighthouse's
    # join window, counted from the first survivor's arrival, long spent), and the other
    # survivor would be healed a round later: two heals for one fault. The survivor that
    # sees the failure aborts its group, so both fail together, meet in one quorum, and the
    # restarted site meets both of them in its first.
    records, codes = _run(tmp_path, num_sites=3, min_sites=2, steps=24, kills={0: 5}, restart=True,
                          site_timeout_s=20.0)
    assert codes == {0: 0, 1: 0, 2: 0}
    s0, s1, s2 = records
    failed = {}
    for s, survivor in ((1, s1), (2, s2)):
        assert not any("rejoined" in line for line in logs(survivor)), logs(survivor)  # never healed
        lost = [r for r in survivor if r.get("ft") == "not_committed"]
        assert len(lost) == 1, logs(survivor)  # one round not committed, the one site 0 died in
        failed[s] = lost[0]["t"]
    assert abs(failed[1] - failed[2]) < 5.0, failed  # together, not one of them a timeout later
    restarted = s0[starts(s0)[1]:]
    first = quorums(restarted)[0]
    assert first["healed"] and first["sites"] == [0, 1, 2], quorums(restarted)
    assert sum("rejoined" in line for line in logs(restarted)) == 1
    # ... and the survivors' own quorum of that id holds the same three
    for survivor in (s1, s2):
        assert [q["sites"] for q in quorums(survivor) if q["id"] == first["id"]][0] == [0, 1, 2]
    assert by_round(s1) == by_round(s2) and all(by_round(s1)[k] == d for k, d in by_round(restarted).items())


@needs_torchft
@pytest.mark.slow
def test_one_survivor_waits_at_the_floor_and_a_fresh_site_cannot_overwrite_it(tmp_path):
    # 2 sites, --lsgd-min-sites 2: site 1 dies after step 3 (mid round 2); site 0 must not
    # commit alone: it waits, then the restarted (fresh, untrained) site 1 heals from it.
    # The lighthouse would form a quorum of one: the floor is the sites' own.
    records, codes = _run(tmp_path, num_sites=2, min_sites=2, steps=12, kills={1: 3}, restart=True, lighthouse_min=1)
    s0, s1 = records
    assert codes == {0: 0, 1: 0}
    assert any("waits for --lsgd-min-sites 2" in line for line in logs(s0)), logs(s0)
    r0 = rounds(s0)
    assert [x["round"] for x in r0[:2]] == [1, 1]  # round 2 lost with its peer, never committed alone
    # The round after the return continues from site 0's trained anchor, not the fresh
    # site's initial weights: replayed exactly, with site 1's inner momentum healed from site 0.
    at_join = r0[1]
    first = at_join["step"]  # the rolled-back round's steps ran: the next round starts here
    momenta = {0: inner_momentum(0, first), 1: inner_momentum(0, first)}  # site 1's is site 0's, healed
    anchor, momentum = replay_round(at_join["anchor"], at_join["momentum"], (0, 1), first, 2, momenta)
    assert r0[2]["round"] == 2 and r0[2]["anchor"] == anchor and r0[2]["momentum"] == momentum
    assert initial_params().tolist() != at_join["anchor"]
    fresh = by_round(s1[starts(s1)[1]:])
    assert min(fresh) == 2 and fresh == {k: d for k, d in by_round(s0).items() if k >= 2}


@needs_torchft
@pytest.mark.slow
def test_without_faults_torchft_gives_the_numbers_of_a_plain_run(tmp_path):
    # int8: the quantized mean and its error feedback go through ElasticComm too.
    compression = "int8"
    plain, codes = _run(tmp_path / "plain", num_sites=3, min_sites=3, steps=8, compression=compression,
                        lighthouse=False)
    assert set(codes.values()) == {0}
    elastic, codes = _run(tmp_path / "ft", num_sites=3, min_sites=3, steps=8, compression=compression)
    assert set(codes.values()) == {0}
    for p, e in zip(plain, elastic):
        assert [(r["round"], r["digest"], r["error"]) for r in rounds(p)] == \
               [(r["round"], r["digest"], r["error"]) for r in rounds(e)]
        assert len(rounds(e)) == 4


def test_fault_tolerance_flags_are_checked():
    with pytest.raises(ValueError, match="--lsgd-fault-tolerance torchft does not support --lsgd-algorithm acco"):
        FaultToleranceOptions(mode="torchft").validate(algorithm="acco", num_sites=2)
    with pytest.raises(ValueError, match=r"--lsgd-min-sites must be in \[1, --num-sites 2\]"):
        FaultToleranceOptions(mode="torchft", min_sites=3).validate(algorithm="diloco", num_sites=2)
    with pytest.raises(ValueError, match="--lsgd-min-sites needs --lsgd-fault-tolerance torchft"):
        FaultToleranceOptions(min_sites=2).validate(algorithm="diloco", num_sites=2)
    with pytest.raises(ValueError, match=r"--lsgd-ft-max-failed-rounds must be >= 0 \(0: never stop; got -1\)"):
        FaultToleranceOptions(mode="torchft", max_failed_rounds=-1).validate(algorithm="diloco", num_sites=2)
    with pytest.raises(ValueError, match=r"--lsgd-ft-lone-site train needs --lsgd-min-sites >= 2 \(with 1 a site "
                                         r"alone trains at once\)"):
        FaultToleranceOptions(mode="torchft", lone_site="train").validate(algorithm="diloco", num_sites=2)
    with pytest.raises(ValueError, match="--lsgd-ft-lone-site needs --lsgd-fault-tolerance torchft"):
        FaultToleranceOptions(lone_site="train").validate(algorithm="diloco", num_sites=2)
    if importlib.util.find_spec("torchft") is not None:  # else the install message (next test) is the answer
        FaultToleranceOptions(mode="torchft", min_sites=2).validate(algorithm="diloco", num_sites=2)
        FaultToleranceOptions(mode="torchft", min_sites=2, lone_site="train").validate(algorithm="diloco", num_sites=2)


@pytest.mark.parametrize("extra,message", [
    ([], "each site is its own torchrun job; give its --lsgd-site in [0, --num-sites 2) (got -1)"),
    (["--lsgd-site", "2"], "--lsgd-site in [0, --num-sites 2) (got 2)"),
    (["--lsgd-site", "0", "--lsgd-warmup-iters", "4"], "--lsgd-warmup-iters does not work with --lsgd-fault-tolerance"),
    (["--lsgd-site", "0", "--simulate-clock"], "--simulate-clock does not work with --lsgd-fault-tolerance"),
    (["--lsgd-site", "0", "--lsgd-algorithm", "dilocox", "--lsgd-compression", "lowrank-int4", "--lsgd-rank", "2",
      "--lsgd-adaptive"], "--lsgd-adaptive does not work with --lsgd-fault-tolerance torchft: its H is agreed"),
    (["--lsgd-site", "0", "--lsgd-algorithm", "cocodc", "--lsgd-interval", "4", "--lsgd-fragment-sync-delay", "0"],
     "--lsgd-fragment-sync-delay 0 does not work with --lsgd-fault-tolerance torchft"),
    (["--lsgd-site", "0", "--lsgd-algorithm", "acco", "--global-batch-size", "8"],
     "does not support --lsgd-algorithm acco"),
])
def test_the_run_checks_fault_tolerance_against_its_other_flags(extra, message):
    from megatron_lsgd.training.arguments import build_config, parse_args

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3", "--mock-data", "--vocab-size", "128",
            "--num-sites", "2", "--lsgd-algorithm", "diloco", "--lsgd-fault-tolerance", "torchft"]
    if importlib.util.find_spec("torchft") is None:
        pytest.skip("torchft is not installed")
    with pytest.raises(ValueError, match=re.escape(message)):
        build_config(parse_args(base + extra), 1)


def test_sync_runs_under_fault_tolerance_with_compression_and_zero1():
    # issue 49 item 2: a quorum per step (test_elastic_rounds.py, test_fault_tolerance_pretrain.py)
    from megatron_lsgd.training.arguments import build_config, parse_args

    if importlib.util.find_spec("torchft") is None:
        pytest.skip("torchft is not installed")
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3", "--mock-data", "--vocab-size", "128",
            "--num-sites", "2", "--lsgd-algorithm", "sync", "--lsgd-fault-tolerance", "torchft", "--lsgd-site", "1"]
    config = build_config(parse_args(base + ["--lsgd-compression", "int8", "--use-distributed-optimizer"]), 1)
    assert config.lsgd.algorithm == "sync" and config.fault_tolerance.site == 1


def test_dreamddp_runs_under_fault_tolerance_with_its_schedule_flags():
    # issue 49 item 2: a period per round (test_dreamddp_elastic.py, test_fault_tolerance_pretrain.py)
    from megatron_lsgd.training.arguments import build_config, parse_args

    if importlib.util.find_spec("torchft") is None:
        pytest.skip("torchft is not installed")
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--train-iters", "8", "--lr", "1e-3", "--mock-data", "--vocab-size", "128",
            "--num-sites", "2", "--lsgd-algorithm", "dreamddp", "--lsgd-interval", "2", "--lsgd-fault-tolerance",
            "torchft", "--lsgd-site", "0"]
    config = build_config(parse_args(base + ["--use-distributed-optimizer", "--lsgd-dreamddp-reprofile-interval",
                                             "4"]), 1)
    assert config.lsgd.algorithm == "dreamddp" and config.fault_tolerance.enabled


def test_a_sites_torchft_group_is_on_the_inter_site_backends_device(monkeypatch):
    """--inter-site-backend gloo in a GPU run puts torchft's group on the host. Two sites that
    share one GPU cannot meet on NCCL: with the run's device there, every round of the
    gpu_check's elastic step failed with NCCL's "invalid usage" on an H200 and the job never
    ended."""
    from megatron_lsgd.core.lsgd.devices import InterSiteDevices
    from megatron_lsgd.training import elastic
    from megatron_lsgd.training.arguments import build_config, parse_args

    if importlib.util.find_spec("torchft") is None:
        pytest.skip("torchft is not installed")
    seen = {}
    monkeypatch.setattr(elastic, "TorchftMembership", lambda comm, options, **kw: seen.update(kw) or SimpleNamespace())
    monkeypatch.setattr(elastic, "_site_store", lambda host: (None, (host, 1234)))
    monkeypatch.setattr(elastic.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(elastic.dist, "get_world_size", lambda: 1)
    config = build_config(parse_args(
        ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3", "--mock-data", "--vocab-size", "128",
         "--num-sites", "2", "--lsgd-algorithm", "diloco", "--lsgd-fault-tolerance", "torchft", "--lsgd-site", "1",
         "--inter-site-backend", "gloo"]), 1)
    devices = InterSiteDevices(group=torch.device("cpu"), run=torch.device("cuda", 0))
    comm, _ = elastic.elastic_site(config, SimpleNamespace(rank=0, site_rank=1), None, devices)
    assert seen["device"] == torch.device("cpu") and comm.devices is devices


def test_each_site_is_a_world_of_its_own_with_its_own_checkpoints():
    """The world torchrun gives is one site (TP x PP x DP_intra); --save/--load gain site<k>."""
    from megatron_lsgd.training.arguments import build_config, parse_args

    if importlib.util.find_spec("torchft") is None:
        pytest.skip("torchft is not installed")
    args = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3", "--mock-data", "--vocab-size", "128",
            "--num-sites", "3", "--lsgd-algorithm", "diloco", "--lsgd-fault-tolerance", "torchft", "--lsgd-site", "1",
            "--pipeline-model-parallel-size", "2", "--save", "/ckpt", "--load", "/ckpt"]
    config = build_config(parse_args(args), 4)
    assert (config.dims.pp, config.dims.dp_intra, config.dims.sites) == (2, 2, 3)
    assert config.checkpoint.save == config.checkpoint.load == os.path.join("/ckpt", "site1")


def test_without_torchft_the_flag_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft -> ImportError
    with pytest.raises(ValueError, match=r'needs torchft.*pip install -e "\.\[ft\]"'):
        FaultToleranceOptions(mode="torchft").validate(algorithm="diloco", num_sites=2)


class _Buffer:
    def __init__(self):
        self.value = torch.zeros(2)

    def state_dict(self):
        return {"value": self.value.clone()}

    def load_state_dict(self, state):
        self.value.copy_(state["value"])


def _membership(commit: bool):
    return scripted_membership(fail=() if commit else {0}, present=[0, 1])  # a peer failed: its site or ours says no


def test_a_round_that_does_not_commit_returns_nothing_and_puts_the_error_feedback_back():
    buf = _Buffer()

    def mean():
        buf.value += 1  # what a compressor's error feedback does during the mean
        return "mean"

    kept = _membership(commit=True)
    assert kept.reduce(mean, undo=[buf]) == "mean" and buf.value.tolist() == [1, 1]
    lost = _membership(commit=False)  # a peer failed: its site or ours says no
    assert lost.reduce(mean, undo=[buf]) is None and buf.value.tolist() == [1, 1]
    assert lost._failed == [0, 1] and (lost.rounds_attempted, lost.rounds_committed) == (1, 0)

    def broken():
        buf.value += 1
        raise RuntimeError("Connection closed by peer")

    failing = _membership(commit=True)
    assert failing.reduce(broken, undo=[buf]) is None and buf.value.tolist() == [1, 1]
    assert "Connection closed" in str(failing.manager.error) and failing._failure == "Connection closed by peer"

    def unconfigured():  # what torchft's wrapper raises when the quorum could not rebuild the group
        raise AssertionError("process group not initialized")

    survivor = _membership(commit=True)
    assert survivor.reduce(unconfigured, undo=[buf]) is None and "not initialized" in survivor._failure


class _Group:
    """The site's torchft group, counting aborts (a real one closes its connections)."""

    def __init__(self):
        self.aborts = 0

    def abort(self):
        self.aborts += 1

    def allreduce(self, tensors, opts):
        raise RuntimeError("Connection closed by peer")


def test_a_failed_collective_aborts_the_sites_group_at_once():
    # A survivor that sees a collective fail closes its connections, so a survivor waiting on
    # it (a ring neighbour that is alive) fails now, not after --lsgd-ft-timeout, and both
    # reach the next quorum together (docs/fault_tolerance.md, "One heal per fault").
    def broken():
        raise RuntimeError("Connection closed by peer")

    issued = _membership(commit=True)
    issued.pg = _Group()
    assert issued.reduce(broken) is None and issued.pg.aborts == 1

    def waiting():  # issued fine, fails while the site waits for it
        def wait():
            raise RuntimeError("Timed out waiting 5000ms for recv operation to complete")
        return SimpleNamespace(done=False, result=None, poll=lambda: False, wait=wait)

    waited = _membership(commit=True)
    waited.pg = _Group()
    assert waited.finish(waited.start(waiting)) is None and waited.pg.aborts == 1 and "Timed out" in waited._failure

    mean = _membership(commit=True)  # a mean over the sites outside the round's reduction
    mean.pg = _Group()
    mean.manager.num_participants = lambda: 2
    value = torch.ones(2)
    mean.mean_over_sites(value)
    assert value.tolist() == [1, 1] and mean.pg.aborts == 1 and mean.manager.error is not None

    kept = _membership(commit=False)  # a peer said no, nothing failed here: the group is left alone
    kept.pg = _Group()
    assert kept.reduce(lambda: "m") is None and kept.pg.aborts == 0


def test_a_rounds_later_collectives_run_within_it_a_failure_reported_and_nothing_sent_after():
    # edit's norm gather and per-unit exchanges: collectives issued after `start`, each
    # through `within`; the first that fails is reported (the round does not commit), the
    # group aborted, and the ones after it are not tried (`failed` comes back instead).
    buf, calls = _Buffer(), []

    def unit(k, fails=False):
        def call():
            calls.append(k)
            if fails:
                raise RuntimeError("Connection reset by peer")
            buf.value += 1
            return k
        return call

    m = _membership(commit=True)
    m.pg = _Group()
    ticket = m.start(lambda: SimpleNamespace(done=True, result="synced", poll=lambda: True, wait=lambda: "synced"),
                     undo=[buf])
    assert m.within(ticket, unit(0)) == 0
    assert m.within(ticket, unit(1, fails=True), "lost") == "lost" and m.pg.aborts == 1
    assert m.within(ticket, unit(2), "lost") == "lost" and calls == [0, 1]
    assert m.finish(ticket) is None and buf.value.tolist() == [0, 0]  # put back as it was at `start`
    assert "Connection reset" in m._failure
    kept = _membership(commit=True)
    ticket = kept.start(lambda: SimpleNamespace(done=True, result="synced", poll=lambda: True, wait=lambda: "synced"))
    assert kept.within(ticket, unit(3)) == 3 and kept.finish(ticket) == "synced"
    assert list(kept.round_sites()) == [0, 1]  # the rows of a gather: the quorum group's order


# ---- a lone site (--lsgd-ft-lone-site) --------------------------------------------------------------
def _lone(lone_site: str):
    """A site of two with --lsgd-min-sites 2, alone in its quorum (the scripted Manager's)."""
    m = scripted_membership()
    m.options.min_sites, m.options.max_wait_s, m.options.lone_site = 2, 0.05, lone_site
    m.comm.configured_sites = 2
    return m


def test_a_lone_site_stops_after_the_wait_by_default_and_says_what_would_train_alone():
    from megatron_lsgd.core.lsgd.comm import InterSiteTimeout

    lone = _lone("stop")
    with pytest.raises(InterSiteTimeout, match=r"fewer than --lsgd-min-sites 2 sites for --lsgd-ft-max-wait 0.05 s "
                                               r"\(missing: 1; .*--lsgd-ft-lone-site train would train alone\)"):
        lone.round_started()
    assert lone.lines[0] == ("site 0 waits for --lsgd-min-sites 2 sites (0 s, 1 site(s) in the quorum: 0); "
                             "missing: 1; stops at --lsgd-ft-max-wait 0.05 s")
    assert lone.rounds_attempted == 0 and not lone.alone


def test_a_lone_site_trains_alone_after_the_wait_and_rejoins_when_a_site_comes():
    lone = _lone("train")
    lone.round_started()  # waits 0.05 s, then trains alone
    assert lone.lines[0].endswith("; trains alone at --lsgd-ft-max-wait 0.05 s if no other site has come "
                                  "(--lsgd-ft-lone-site train)")
    assert lone.lines[-1].startswith("site 0 trains alone: no other site in its quorum for --lsgd-ft-max-wait 0.05 s")
    assert lone.alone and lone.reduce(lambda: "its own") == "its own" and lone.rounds_committed == 1
    quorums = lone.manager.quorums
    lone.round_started()  # alone already: no wait, one quorum
    assert lone.manager.quorums == quorums + 1 and lone.reduce(lambda: "again") == "again"
    lone.manager.num_participants = lambda: 2  # another site joins its quorum: the floor holds again
    lone._gather_present = lambda: [0, 1]
    lone.round_started()
    assert not lone.alone and lone.lines[-1] == "site 0 no longer trains alone: sites now 0,1 (committed round 2)"
    lone.reduce(lambda: "mean")
    lone.manager.num_participants = lambda: 1  # and leaves: a new wait before training alone again
    lone._gather_present = lambda: [0]
    lines = len(lone.lines)
    lone.round_started()
    new = lone.lines[lines:]
    assert new[0] == "site 0: sites now 0 (were 0,1)" and "waits for --lsgd-min-sites 2" in new[1]
    assert new[-1].startswith("site 0 trains alone") and lone.alone


def test_a_quorum_that_never_forms_is_the_runs_one_error_line():
    # a lighthouse whose --min_replicas a lone site cannot meet: torchft's quorum times out
    # after --lsgd-ft-max-wait with its own words ("status: Cancelled ..."); the site names the flag
    from megatron_lsgd.core.lsgd.comm import InterSiteTimeout

    for lone_site, hint in (("stop", r"none\)$"), ("train", r"none; --lsgd-ft-lone-site train needs a lighthouse "
                                                              r"that forms a quorum of one site")):
        lone = _lone(lone_site)

        def timed_out(timeout=None):
            raise TimeoutError('status: Cancelled, message: "Timeout expired"')

        lone.manager.start_quorum = timed_out
        with pytest.raises(InterSiteTimeout, match=r"^site 0: no quorum in --lsgd-ft-max-wait 0.05 s \(the lighthouse "
                                                   r"formed none with this site: .*sites of the last round: " + hint):
            lone.round_started()


def _until(done, deadline_s: float) -> None:
    import time

    end = time.monotonic() + deadline_s
    while not done() and time.monotonic() < end:
        time.sleep(0.01)


def test_a_site_that_knows_no_other_says_it_waits_within_seconds(monkeypatch):
    # a blocking quorum (a lighthouse that holds it back) says so after ALONE_LINE_S, not
    # log_every, when the site has no other site in its last quorum (or none yet)
    import time

    from megatron_lsgd.core.lsgd.fault_tolerance import torchft_membership

    monkeypatch.setattr(torchft_membership, "ALONE_LINE_S", 0.05)
    for present, lines in (([], 1), ([0], 1), ([0, 1], 0)):
        m = _lone("stop")
        m.present = present
        if lines:  # held until the watcher speaks, at most 5 s: far before log_every (60 s here), the line it must beat
            m.manager.start_quorum = lambda timeout=None, m=m: _until(lambda: m.lines, 5.0)
        else:  # 20x the line's delay: long enough for a line that must not come
            m.manager.start_quorum = lambda timeout=None: time.sleep(1.0)
        m._quorum()
        assert len(m.lines) == lines, (present, m.lines)
        if lines:  # (the seconds waited: 0 on an idle machine, more where the watcher wakes late under load)
            assert re.fullmatch(rf"site 0 waits for --lsgd-min-sites 2 sites \(\d+ s, no quorum yet\); sites of the "
                                rf"last round: {','.join(map(str, present)) or 'none'}; stops at --lsgd-ft-max-wait "
                                rf"0\.05 s", m.lines[0]), m.lines
