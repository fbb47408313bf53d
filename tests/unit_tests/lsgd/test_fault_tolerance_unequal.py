"""Elastic sites of different data-parallel sizes (--site-data-parallel-sizes 2,1 with
--lsgd-fault-tolerance torchft; fault_tolerance/lanes.py, docs/heterogeneous_sites.md).

pretrain_gpt.py, one job per site (site 0 of 2 ranks, site 1 of 1), a lighthouse in the
test. Without faults the torchft lane groups carry exactly the plain run's lane means (each
lane joins one rank of each site, the weights are the sites' shares of the tokens), so every
checkpointed tensor and logged loss must equal the 3-rank run without fault tolerance bit
for bit. With the DP-1 site killed and restarted fresh, it is healed lane by lane from the
two ranks of site 0 and must agree with it at every later committed round (digests per lane).
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from tests.unit_tests.checkpointing.launch import (Job, assert_same, finish_together, kill, load_tree, losses, read,
                                                  run, start, start_together)
from tests.unit_tests.lsgd.test_fault_tolerance_pretrain import (COCODC, DILOCOX, H, HOOKS, PACE, SYNC, _checkpoint,
                                                                 _iteration, _job, _model, _saved_iterations, _site,
                                                                 _until)

torchft = pytest.importorskip("torchft", reason="torchft is not installed (pip install -e \".[ft]\")")
os.environ.setdefault("RUST_LOG", "warn")

from tools.benchmarks.elastic.chaos import check_digests, read_digests  # noqa: E402
from tools.benchmarks.elastic.ft_site import start_lighthouse  # noqa: E402

SIZES = ["--site-data-parallel-sizes", "2,1"]


class _Sum:
    """A torchft group of one: the sum over the sites is the payload itself."""

    def allreduce(self, tensors, opts):
        return SimpleNamespace(wait=lambda: None, is_completed=lambda: True)


def test_the_weights_follow_the_quorum():
    # Sites of 2, 1 and 1 replicas: site 0 weighs 2/4 with everyone, 2/3 when site 1 is gone
    # (a site that left keeps no weight); with one site there is nothing to average.
    from megatron_lsgd.core.lsgd.fault_tolerance.elastic_comm import ElasticComm

    comm = ElasticComm(3, site=0, site_sizes=(2, 1, 1))
    for present, weight in (([0, 1, 2], 2 / 4), ([0, 2], 2 / 3), ([0], 1.0)):
        comm.set_sites(_Sum(), len(present), present)
        value = torch.ones(4)
        comm.all_reduce_mean(value)
        assert comm.site_weight == weight and value.tolist() == [torch.tensor(weight).item()] * 4, present


def test_a_rank_of_two_lanes_takes_each_lanes_per_parameter_state_from_its_own_payload():
    from megatron_lsgd.core.lsgd.fault_tolerance.lane_heal import merge_lanes

    def payload(value):  # a live peer's rank: its own lane right, the other stale (value + 10)
        return {"synchronizer": {"outer": {"anchors": [torch.full((8,), float(value))],
                                           "momentum": [torch.full((8,), -float(value))]}, "steps_in_round": value},
                "model": value}

    merged = merge_lanes([payload(1), payload(2)], [0, 1], 2, {"outer/anchors": [], "outer/momentum": []})
    assert merged["synchronizer"]["outer"]["anchors"][0].tolist() == [1.0] * 4 + [2.0] * 4
    assert merged["synchronizer"]["outer"]["momentum"][0].tolist() == [-1.0] * 4 + [-2.0] * 4
    assert merged["model"] == 1 and merged["synchronizer"]["steps_in_round"] == 1  # the rest: the first lane's
    # a rank of lanes 2 and 3 of 4
    merged = merge_lanes([payload(1), payload(2)], [2, 3], 4, {"outer/anchors": []})
    assert merged["synchronizer"]["outer"]["anchors"][0].tolist() == [1.0] * 6 + [2.0] * 2


def test_a_heal_re_cuts_what_is_laid_out_on_a_ranks_part():
    # A fragment over values 2..6 of a bucket of 8 (L = 2: lanes 0..3 and 4..7). Site 0's
    # replicas hold 2..3 and 4..6; site 1's one replica 2..6. Each way, each value comes from
    # the lane that holds it, wherever the sender's part of the fragment starts.
    from megatron_lsgd.core.lsgd.fault_tolerance.lane_heal import recut
    from megatron_lsgd.core.optimizer.shard_views import ShardRange

    full = SimpleNamespace(ranges=[ShardRange(0, 2, 7)])
    values = torch.arange(8.0)
    merged = recut([[values[2:4]], [values[4:7] + 10]], [2, 2], full, [0, 1], 2, 1, 0, [8])
    assert [t.tolist() for t in merged] == [[2.0, 3.0, 14.0, 15.0, 16.0]]
    assert [t.tolist() for t in recut([[values[2:7]]], [1], full, [1], 2, 2, 1, [8])] == [[4.0, 5.0, 6.0]]
    assert recut([[values[2:7]]], [1], SimpleNamespace(ranges=[ShardRange(0, 1, 3)]), [1], 2, 2, 1, [8]) == []


def test_lane_group_ranks_are_a_sites_ranks_when_sites_are_equal():
    from megatron_lsgd.core.lsgd.fault_tolerance.lanes import group_rank
    from megatron_lsgd.core.parallel_state import ParallelDims

    d = ParallelDims.from_world(8, 2, 2, 2)  # TP 2 x PP 2 x DP 1 per site
    for r in range(4):
        c = d.coords(r)
        assert group_rank(c.tp, c.dp_intra, c.pp, d.tp, d.lanes) == r
    assert sorted(group_rank(t, j, p, 2, 2) for t in range(2) for j in range(2) for p in range(2)) == list(range(8))
RANKS = (2, 1)
DILOCO = ("--lsgd-algorithm", "diloco")
STREAMING = ("--lsgd-algorithm", "streaming-diloco", "--lsgd-fragments", "2")
COCODC_DENSE = ("--lsgd-algorithm", "cocodc", "--lsgd-fragments", "2", "--lsgd-cocodc-syncs-per-round", "8",
                "--lsgd-fragment-sync-delay", "3")


@pytest.mark.slow
def test_elastic_sites_of_2_and_1_replicas_equal_the_plain_run_and_heal(tmp_path):
    # 1. Without faults, every algorithm that takes such sites: the plain 3-rank run's numbers,
    # bit for bit.
    for algorithm, interval, iters in ((DILOCO, H, 4), (SYNC, H, 4), (DILOCOX, H, 6), (STREAMING, 4, 8),
                                       (COCODC, 4, 8)):
        name = algorithm[1]
        extra = ["--train-iters", str(iters), "--global-batch-size", "12"] + SIZES
        plain = run(_job(2, extra=extra + ["--save", str(tmp_path / f"{name}-plain")], algorithm=algorithm,
                         interval=interval), 3, str(tmp_path / f"{name}-plain.log"))
        lighthouse = start_lighthouse(2, join_timeout_ms=60_000)  # every round waits for both sites
        try:
            args = _job(2, lighthouse.address(), 2, extra + ["--save", str(tmp_path / f"{name}-ft")], algorithm,
                        interval)
            jobs = [Job(_site(args, site), RANKS[site], str(tmp_path / f"{name}-ft{site}.log")) for site in range(2)]
            finish_together(start_together(jobs), jobs)
        finally:
            lighthouse.shutdown()
        reference = load_tree(str(tmp_path / f"{name}-plain" / f"iter_{iters:07d}"))
        elastic = {}
        for site in range(2):
            elastic.update(_checkpoint(str(tmp_path / f"{name}-ft"), site, iters))
        assert sorted(elastic) == sorted(reference), name
        assert_same(elastic, reference, name)
        for site in range(2):
            assert losses(read(str(tmp_path / f"{name}-ft{site}.log"))) == losses(plain), name
        assert len(losses(plain)) == iters

    # 2. A site killed and restarted. The DP-1 site, fresh, healed from site 0's two ranks lane
    # by lane: diloco; dilocox, whose heal hands over the Δ taken and not yet issued; cocodc on
    # a dense schedule (a sync every step, each landing 3 steps later), whose heal hands over
    # fragment means in flight and their snapshots: each laid out on the sender's part of the
    # model and re-cut for the receiver. Then cocodc's DP-2 site, from its own checkpoint (it
    # counts itself a round behind), each of its ranks healed from the one rank of site 1.
    kills = ((DILOCO, H, 14, 3, 1), (DILOCOX, H, 14, 3, 1), (COCODC_DENSE, 8, 5, 4, 1),
             (COCODC_DENSE, 8, 5, 12, 0))  # (algorithm, H, rounds, the victim's last quorum, the victim)
    for algorithm, interval, rounds, die_after, victim in kills:
        _kill_and_heal(tmp_path / f"{algorithm[1]}-victim{victim}", algorithm, interval, rounds * interval,
                       die_after, victim, from_checkpoint=victim == 0)


def _kill_and_heal(tmp_path, algorithm, interval: int, iters: int, die_after: int, victim: int,
                   from_checkpoint: bool) -> None:
    # --lsgd-min-sites 1: the victim dies right after a quorum, before that round's mean. The
    # survivor rolls the round back and trains alone; the victim comes back (a process started
    # with the others, held until the survivor has trained a round alone), is healed, and
    # agrees with the survivor from then on.
    os.makedirs(tmp_path)
    survivor = 1 - victim
    save, digests = str(tmp_path / "ckpt"), str(tmp_path / "digests")
    lighthouse = start_lighthouse(1, heartbeat_timeout_ms=1000, join_timeout_ms=5000)
    logs = {s: str(tmp_path / f"site{s}.log") for s in range(2)}
    base = SIZES + ["--global-batch-size", "12", "--train-iters", str(iters), "--save", save, "--lsgd-ft-digests",
                    digests, "--simulate-slow-ranks", "0,1,2", "--slow-factor", PACE]
    args = _job(2, lighthouse.address(), 1, base, algorithm, interval)
    release = str(tmp_path / "release")
    procs, others = {}, []
    marker = f"was not committed (lost site {victim}"
    back = f"site {survivor}: sites now 0,1 (were {survivor})"
    try:
        victim_args = [a if a != save else str(tmp_path / "victim") for a in args]
        others.append(start(_site(victim_args, victim) + ["--lsgd-min-sites", "2"], RANKS[victim], logs[victim],
                            script=HOOKS, env={"LSGD_TEST_DIE_AFTER_QUORUM": str(die_after),
                                               "LSGD_TEST_READY_FILE": str(tmp_path / "victim.ready")}))
        procs[survivor] = start(_site(args, survivor), RANKS[survivor], logs[survivor], script=HOOKS,
                                env={"LSGD_TEST_HOLD_UNTIL": str(tmp_path / "victim.ready")})
        again = ["--load", victim_args[victim_args.index("--save") + 1]] if from_checkpoint else []
        others.append(start(_site(args, victim) + ["--lsgd-min-sites", "2"] + again, RANKS[victim],
                            logs[victim] + ".restart", env={"LSGD_TEST_HOLD_UNTIL": release}, script=HOOKS))
        _until(lambda: marker in read(logs[survivor]), "the survivor to roll back", procs.values())
        assert others[0].wait(timeout=120) != 0
        rolled = _iteration(logs[survivor])
        _until(lambda: _iteration(logs[survivor]) > rolled + interval, "a round alone", procs.values())
        open(release, "w").close()
        procs[victim] = others.pop()
        _until(lambda: all(p.poll() is not None for p in procs.values()), "the job's end", timeout=600)
        assert {s: p.returncode for s, p in procs.items()} == {0: 0, 1: 0}
    finally:
        for p in list(procs.values()) + others:
            kill(p)
        lighthouse.shutdown()
    text, restarted = read(logs[survivor]), read(logs[victim] + ".restart")
    assert text.count(marker) == 1 and back in text[text.index(marker):], text[-3000:]
    assert "rejoined at committed round" in restarted, restarted[-3000:]
    if from_checkpoint:
        assert "loaded checkpoint" in restarted.split("rejoined at committed round")[0], restarted[-3000:]
    # every lane's anchor and outer momentum, on both sites (the killed process's included)
    files = read_digests(digests)
    assert sorted(files) == ["site0_lane0.jsonl", "site0_lane1.jsonl", "site1_lane0.jsonl", "site1_lane1.jsonl"]
    agreed = check_digests(files)
    assert agreed["disagreements"] == [] and agreed["rounds_checked"] >= 4, agreed
    healed = int(restarted.split("rejoined at committed round ")[1].split(":")[0])
    held = [{r["round"] for name, records in files.items() if name.startswith(f"site{s}_") for r in records}
            for s in range(2)]
    assert max(held[0] & held[1]) > healed, (healed, held)  # compared after the heal (when it came late: once)
    # the model (diloco: each site's is the anchor after a round), and the job's position and
    # schedule, at every round both saved after the heal
    later = [i for i in _saved_iterations(save, victim) if i in _saved_iterations(save, survivor)]
    assert later and later[-1] == iters
    for i in later:
        if algorithm == DILOCO:
            assert_same(_model(_checkpoint(save, 1, i)), _model(_checkpoint(save, 0, i)), f"iteration {i}")
        meta = [_meta(save, s, i) for s in range(2)]
        assert meta[0]["consumed_samples"] == meta[1]["consumed_samples"]
        assert meta[0]["site_schedulers"][0] == meta[1]["site_schedulers"][1]
        assert meta[1]["site_consumed_samples"][1] * 2 == meta[0]["site_consumed_samples"][0]  # its share: 1 of 3


def _meta(save: str, site: int, iteration: int) -> dict:
    with open(os.path.join(save, f"site{site}", f"iter_{iteration:07d}", "metadata.json")) as f:
        return json.load(f)
