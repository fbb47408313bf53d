"""Sites of different data-parallel sizes (--site-data-parallel-sizes, docs/heterogeneous_sites.md).

- the layout: site offsets, the lanes that cross sites and their dp_inter groups (pure);
- bad input and unsupported combinations: one error naming the flag (build_config; one run
  in process for the exit code and the single `error:` line);
- the token-weighted mean across sites against a hand computation, on 3 spawned ranks whose
  ZeRO-1 shards differ between the sites (SiteSplit's lanes), and the loop's weighted mean
  and sum (UnequalSites);
- equivalence runs (one spawn of 3 ranks, several runs back to back):
  * sync with sites DP 2 + DP 1 == one site of DP 3: the weighted mean of the sites' gradients,
    2/3 x (site 0's two replicas' mean) + 1/3 x (site 1's), is the mean over the 3 replicas,
    and each global data-parallel index reads what it reads in one DP-3 group;
  * diloco (H 2, AdamW inner, Nesterov outer) with sites DP 2 + DP 1 == diloco on 3 sites of
    DP 1, on data whose replicas 0 and 1 read the same samples (twin_replica_data.py). Why
    it holds: in the 3-site run sites 0 and 1 start equal and read the same data, so they
    stay bit-identical and their pseudo-gradients are one and the same Δ_a; the outer mean is
    (Δ_a + Δ_a + Δ_b) / 3. In the 2-site run site 0's two replicas read those same samples,
    so its site-reduced gradient (g + g) / 2 is g exactly, it follows site 0's trajectory of
    the 3-site run (AdamW is elementwise, so ZeRO-1 shards do not change it) and its Δ is
    Δ_a; site 1 is site 2 of the 3-site run. Its weighted mean 2/3 Δ_a + 1/3 Δ_b is the
    same mean, so the outer steps, anchors and losses agree (to float rounding). Equal
    weights (1/2, 1/2) would not: the test fails with them;
  * the same diloco run without ZeRO-1 (site 0's replicas then split what they send);
  * a checkpoint: the diloco run paused at iteration 3 (--exit-interval) and resumed with
    --load reproduces the uninterrupted run bit for bit, each site from its own files; the
    converter carries every site's optimizer state (the oracles are
    _assert_converted_optimizer_state_resumes's docstring);
- the same with two pipeline stages (6 ranks): sync against one site of DP 3, diloco's
  replicas equal at the end.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from megatron_lsgd.core.parallel_state import ParallelDims, enumerate_group_ranks
from megatron_lsgd.training.arguments import build_config, parse_args
from megatron_lsgd.training.checkpointing.layout import read_tracker
from tests.unit_tests.harness import (assert_replicas_identical, assert_resumed_per_site,
                                      assert_same_by_parameter_state, by_parameter_state, convert_lsgd, free_port,
                                      logged_losses, merge_full_params, run_distributed_many, spawn)
from tests.unit_tests.lsgd import twin_replica_data
from tests.unit_tests.training.test_arguments import BASE

FLAG = "--site-data-parallel-sizes"


# ---- layout --------------------------------------------------------------------------------------
def test_sites_of_two_and_one_replica():
    d = ParallelDims.from_world(3, 1, 1, 2, [2, 1])
    assert d.heterogeneous and d.dp == 3 and d.lanes == 2 and d.site_sizes == (2, 1)
    assert [(c.site, c.dp_intra) for c in map(d.coords, range(3))] == [(0, 0), (0, 1), (1, 0)]
    groups = enumerate_group_ranks(d)
    assert groups["dp_intra"] == [(0, 1), (2,)] and groups["site"] == [(0, 1), (2,)]
    assert groups["dp"] == [(0, 1, 2)]
    # lane 0 joins the holders of every bucket's first half, lane 1 of its second half
    assert groups["dp_inter"] == [(0, 2), (1, 2)]
    assert d.lanes_of(0, 1) == [1] and d.lanes_of(1, 0) == [0, 1]
    assert d.site_part(30, 0) == 20 and d.site_part(30, 1) == 10 and d.site_share(0) == 2 / 3


def test_lanes_with_model_parallelism():
    d = ParallelDims.from_world(12, 2, 1, 2, [4, 2])
    for r in range(12):
        c = d.coords(r)
        assert d.rank_of(c.tp, c.dp_intra, c.pp, c.site) == r
    assert d.lanes == 4
    # one group per (tp, lane): site 0's replica j, site 1's replica j // 2
    assert enumerate_group_ranks(d)["dp_inter"] == [(0, 8), (2, 8), (4, 10), (6, 10), (1, 9), (3, 9), (5, 11), (7, 11)]
    d = ParallelDims.from_world(10, 1, 2, 2, [2, 3])  # L = 6: lanes may join the same ranks, each its own
    assert d.lanes == 6 and len(enumerate_group_ranks(d)["dp_inter"]) == 12


def test_equal_sizes_are_the_plain_layout():
    assert ParallelDims.from_world(8, 1, 2, 2, [2, 2]) == ParallelDims.from_world(8, 1, 2, 2)
    d = ParallelDims.from_world(8, 1, 2, 2)
    assert not d.heterogeneous and d.lanes == 2 and d.site_part(30, 1) == 15


# ---- bad input -----------------------------------------------------------------------------------
def _config(extra, world):
    return build_config(parse_args(BASE + extra), world)


@pytest.mark.parametrize("extra,world,message", [
    (["--num-sites", "2", FLAG, "2,1,1"], 4, f"{FLAG} 2,1,1 names 3 sites but --num-sites is 2"),
    (["--num-sites", "2", FLAG, "2,2"], 3, f"{FLAG} 2,2 sum to 4 data-parallel ranks"),
    (["--num-sites", "2", FLAG, "3,0"], 3, f"{FLAG} 3,0: every site needs at least one"),
    (["--num-sites", "2", FLAG, "2;1"], 3, f"{FLAG} '2;1': give one whole number per site"),
    (["--num-sites", "2", FLAG, "2,1", "--global-batch-size", "8"], 3,
     f"is not divisible by --micro-batch-size 2 x data-parallel size 3 (= the sum of {FLAG} 2,1)"),
    (["--num-sites", "2", FLAG, "2,1", "--lsgd-algorithm", "edit"], 3,
     f"{FLAG} 2,1 (sites of different sizes) is supported by --lsgd-algorithm cocodc, diloco, dilocox, "
     f"streaming-diloco, sync only; edit:"),
    (["--num-sites", "2", FLAG, "2,1", "--lsgd-algorithm", "diloco", "--lsgd-compression", "topk-2bit"], 3,
     "cannot be combined with --lsgd-compression topk-2bit: --lsgd-algorithm diloco weights and cuts into lanes "
     "int8, int4 only"),
    (["--num-sites", "2", FLAG, "2,1", "--lsgd-algorithm", "sync", "--lsgd-compression", "int8"], 3,
     "cannot be combined with --lsgd-compression int8: its compressed means are not weighted by tokens"),
    (["--num-sites", "2", FLAG, "2,1", "--lsgd-algorithm", "dilocox", "--lsgd-compression", "lowrank-int4",
      "--lsgd-rank", "2"], 3, "cannot be combined with --lsgd-compression lowrank-int4: --lsgd-algorithm dilocox "
                              "weights and cuts into lanes int8, int4 only"),
    # elastic sites of different sizes (test_fault_tolerance_unequal.py): a world per site, diloco and sync, fp32
    (["--num-sites", "2", FLAG, "2,1", "--lsgd-fault-tolerance", "torchft", "--lsgd-site", "1"], 2,
     f"{FLAG} 2,1: site 1 (--lsgd-site) has 1 data-parallel ranks x TP x PP 1 = 1 ranks, but its torchrun world has 2"),
    (["--num-sites", "2", FLAG, "2,1", "--lsgd-fault-tolerance", "torchft", "--lsgd-site", "0",
      "--lsgd-algorithm", "cocodc", "--lsgd-cocodc-dc-normalize", "mean-square"], 2,
     "--lsgd-cocodc-dc-normalize mean-square does not work with --lsgd-fault-tolerance torchft: its running mean"),
    (["--num-sites", "2", FLAG, "2,1", "--lsgd-fault-tolerance", "torchft", "--lsgd-site", "0",
      "--use-distributed-optimizer"], 2, f"--use-distributed-optimizer does not work with --lsgd-fault-tolerance "
                                         f"torchft: with {FLAG} 2,1 a healing rank"),
    (["--num-sites", "2", FLAG, "2,1", "--lsgd-fault-tolerance", "torchft", "--lsgd-site", "0",
      "--lsgd-compression", "int8"], 2, "--lsgd-compression int8 does not work with --lsgd-fault-tolerance torchft"),
])
def test_bad_sizes_and_unsupported_combinations_name_the_flag(extra, world, message):
    batch = [] if "--global-batch-size" in extra else ["--global-batch-size", "12"]
    with pytest.raises(ValueError) as err:
        _config(extra + batch, world)
    assert message in str(err.value), str(err.value)


@pytest.mark.parametrize("algorithm", ["edit", "a-edit", "dreamddp", "acco", "dpu"])
def test_every_other_algorithm_refuses_with_its_reason(algorithm):
    with pytest.raises(ValueError) as err:
        _config(["--num-sites", "2", FLAG, "2,1", "--global-batch-size", "12", "--lsgd-algorithm", algorithm], 3)
    text = str(err.value)
    assert f"cocodc, diloco, dilocox, streaming-diloco, sync only; {algorithm}: " in text and "\n" not in text


def test_the_supported_algorithms_build():
    for algorithm in ("sync", "diloco", "streaming-diloco", "cocodc", "dilocox"):
        c = _config(["--num-sites", "2", FLAG, "2,1", "--global-batch-size", "12", "--lsgd-algorithm", algorithm], 3)
        assert c.dims.site_dp == (2, 1) and c.num_microbatches == 2


def test_the_supported_algorithms_build_as_elastic_sites():
    pytest.importorskip("torchft", reason="torchft is not installed")
    for algorithm in ("sync", "diloco", "streaming-diloco", "cocodc", "dilocox"):
        for site, ranks in ((0, 2), (1, 1)):  # each site's world is its own
            c = _config(["--num-sites", "2", FLAG, "2,1", "--global-batch-size", "12", "--lsgd-algorithm", algorithm,
                         "--lsgd-fault-tolerance", "torchft", "--lsgd-site", str(site)], ranks)
            assert c.dims.site_dp == (2, 1) and c.dims.world_size == 3 and c.fault_tolerance.site == site


def test_a_bad_value_is_one_error_line(monkeypatch, capsys):
    from tests.unit_tests.checkpointing.single import run_single

    code = run_single([FLAG, "0"], monkeypatch)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and f"{FLAG} 0: every site needs at least one" in lines[-1]


# ---- the weighted mean, by hand ------------------------------------------------------------------
def _weighted_mean_ranks(rank: int, port: int) -> None:
    import torch.distributed as dist

    from megatron_lsgd.core.lsgd.comm import InterSiteComm
    from megatron_lsgd.core.lsgd.membership import UnequalSites
    from megatron_lsgd.core.lsgd.site_split import SiteSplit
    from megatron_lsgd.core.parallel_state import build_process_groups
    from tests.unit_tests.harness import join_as_rank

    join_as_rank(rank, 3, port)
    dist.init_process_group("gloo")
    dims = ParallelDims.from_world(3, 1, 1, 2, [2, 1])
    pgs = build_process_groups(dims)
    site = pgs.site_rank
    # Two buckets of 4 and 8 values; the same full vectors on every replica of a site. Under
    # ZeRO-1 site 0's replica r holds half r of each bucket, site 1's replica all of it.
    full = {0: [torch.tensor([3., 6., 9., 12.]), torch.tensor([0., 3., 6., 9., 12., 15., 18., 21.])],
            1: [torch.tensor([0., 3., 0., -3.]), torch.tensor([30., 0., 0., 0., 0., 0., 0., 3.])]}[site]
    if site == 0:
        r = pgs.dp_intra_rank
        mine = [t[r * t.numel() // 2:(r + 1) * t.numel() // 2].clone() for t in full]
    else:
        mine = [t.clone() for t in full]
    comm = InterSiteComm(pgs.dp_inter, 2, site_weight=dims.site_share(site), rank=pgs.rank, site=site)
    split = SiteSplit(pgs, sharded=True)
    assert len(split.lanes) == (1 if site == 0 else 2)

    def exact(tensors):
        for t in tensors:
            comm.all_reduce_mean(t)
        return tensors

    means = split.mean(comm, [t.clone() for t in mine], exact)
    # by hand: 2/3 of site 0's value + 1/3 of site 1's
    hand = [torch.tensor([2., 5., 6., 7.]), torch.tensor([10., 2., 4., 6., 8., 10., 12., 15.])]
    if site == 0:
        r = pgs.dp_intra_rank
        hand = [t[r * t.numel() // 2:(r + 1) * t.numel() // 2] for t in hand]
    for got, want in zip(means, hand):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # the loop's own values: a loss (the same on a site's replicas) and a sample count
    membership = UnequalSites(pgs.dp, 2, None, pgs.dp_intra_rank == 0, dims.site_share(site))
    loss = torch.tensor([2.0 if site == 0 else 5.0])
    membership.mean_over_sites(loss)
    samples = torch.tensor([8 if site == 0 else 4], dtype=torch.int64)
    membership.sum_over_sites(samples)
    assert abs(float(loss) - 3.0) < 1e-6 and int(samples) == 12  # 2/3 x 2 + 1/3 x 5; 8 + 4
    _square_norm_is_one_float(pgs, site)
    _compressed_lane_means_are_weighted(pgs, site, dims.site_share(site))
    dist.destroy_process_group()


def _shards_of(pgs, site: int, buckets):
    """This rank's ZeRO-1 shards of `buckets` (site 0: replica r holds half r), as views."""
    from megatron_lsgd.core.optimizer.shard_views import ShardRange, ShardViews

    r = pgs.dp_intra_rank
    ranges, tensors, bounds = [], [], []
    for b, t in enumerate(buckets):
        n = t.numel()
        lo, hi = (r * n // 2, (r + 1) * n // 2) if site == 0 else (0, n)
        ranges.append(ShardRange(b, 0, hi - lo))
        tensors.append(t[lo:hi].clone())
        bounds.append((lo, hi))
    return ShardViews("fragment", (), ranges, [], tensors, tensors, [], False), tensors, bounds


def _compressed_lane_means_are_weighted(pgs, site: int, weight: float) -> None:
    """dilocox's int8 mean on sites 2 + 1 (both quantized variants): one compressor per lane,
    each site sending C(w_s x S x M), gives the token-weighted mean 2/3 M_0 + 1/3 M_1 to within
    int8's error (not bit for bit: quantizing is not linear), one result on both ends of each
    lane. The plain mean (M_0 + M_1) / 2 is far outside that bound."""
    import torch.distributed as dist

    from megatron_lsgd.core.lsgd.comm import InterSiteComm
    from megatron_lsgd.core.lsgd.compressors import QuantizedCompressor
    from megatron_lsgd.core.lsgd.reduction import run_blocking
    from megatron_lsgd.core.lsgd.site_split import SiteSplit

    sites = [[torch.randn(8, generator=torch.Generator().manual_seed(10 * s + b)) * 3 for b in range(2)]
             for s in range(2)]
    views, tensors, bounds = _shards_of(pgs, site, sites[site])
    split = SiteSplit(pgs, sharded=True, shard_sizes=[t.numel() for t in tensors])
    comm = InterSiteComm(pgs.dp_inter, 2, site_weight=weight, rank=pgs.rank, site=site)
    hand = [2 / 3 * a + 1 / 3 * b for a, b in zip(*sites)]
    bound = 2 * max(float(t.abs().max()) for ts in sites for t in ts) / 127  # a step of each site's int8 code
    for variant in ("allgather", "alltoall"):
        lanes = [QuantizedCompressor(comm, [(r.numel,) for r in v.ranges], torch.device("cpu"), 4, variant, 8)
                 for v in split.lane_views(views)]
        for compressor in lanes:
            compressor.contribution_scale = weight * 2
        means = run_blocking(split.lane_reduce(comm, views, tensors, [c.reduce for c in lanes]))
        for got, want, (lo, hi) in zip(means, hand, bounds):
            assert float((got - want[lo:hi]).abs().max()) <= bound, variant
        every = [None] * 3
        dist.all_gather_object(every, [m.clone() for m in means])
        for b in range(2):  # site 1's rank holds what site 0's two replicas hold, in halves
            assert torch.equal(torch.cat([every[0][b], every[1][b]]), every[2][b]), variant


def _square_norm_is_one_float(pgs, site: int) -> None:
    """cocodc's norm of a fragment's mean (SiteSplit.square_norm): every rank of both sites gets
    the same float, although site 0's replicas hold halves of parameters that site 1's rank
    holds whole (a norm per parameter piece, summed over the site, would differ in its last bits)."""
    import math

    import torch.distributed as dist

    from megatron_lsgd.core.lsgd.site_split import SiteSplit
    from megatron_lsgd.core.optimizer.shard_views import ShardRange, ShardViews

    g = torch.Generator().manual_seed(5)
    buckets = [torch.randn(4, generator=g) * 3, torch.randn(8, generator=g) / 7]  # the same mean on every site
    params = [[(0, 4)], [(0, 3), (3, 8)]]  # bucket coordinates: one parameter of 4; one of 3 and one of 5
    r = pgs.dp_intra_rank
    ranges, tensors, spans, sizes = [], [], [], []
    for b, t in enumerate(buckets):
        n = t.numel()
        lo, hi = (r * n // 2, (r + 1) * n // 2) if site == 0 else (0, n)  # ZeRO-1 shards
        ranges.append(ShardRange(b, 0, hi - lo))
        tensors.append(t[lo:hi].clone())
        sizes.append(hi - lo)
        spans += [(b, max(a, lo) - lo, min(c, hi) - lo) for a, c in params[b] if max(a, lo) < min(c, hi)]
    views = ShardViews("fragment", (), ranges, [], tensors, tensors, [], False)
    norm = SiteSplit(pgs, sharded=True, shard_sizes=sizes).square_norm(views, tensors, spans, torch.device("cpu"))
    every = [torch.zeros(1, dtype=torch.float64) for _ in range(3)]
    dist.all_gather(every, torch.tensor([norm], dtype=torch.float64))
    assert len({float(x) for x in every}) == 1, [float(x) for x in every]
    want = math.fsum(float(v) ** 2 for t in buckets for v in t)
    assert abs(norm - want) <= 1e-12 * want


@pytest.mark.slow
def test_the_weighted_mean_across_unequal_sites_is_the_hand_computation():
    spawn(_weighted_mean_ranks, args=(free_port(),), nprocs=3, timeout=300)


# ---- equivalence runs ----------------------------------------------------------------------------
COMMON = ["--seq-length", "32", "--micro-batch-size", str(twin_replica_data.MICRO_BATCH), "--global-batch-size",
          str(2 * twin_replica_data.MICRO_BATCH * twin_replica_data.REPLICAS), "--train-iters", "6",
          "--lr", "2e-3", "--lr-decay-style", "constant", "--mock-data", "--vocab-size", "250",
          "--make-vocab-size-divisible-by", "32", "--log-interval", "1", "--eval-iters", "0",
          "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7", "--adam-eps", "1e-6",
          "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ddp-bucket-size", "5000"]
UNEQUAL = ["--num-sites", "2", FLAG, "2,1"]
ZERO1 = ["--use-distributed-optimizer"]
DILOCO = ["--lsgd-algorithm", "diloco", "--lsgd-interval", "2", "--lsgd-warmup-iters", "1"]


def _assert_same_training(a, b, rtol=1e-6):
    torch.testing.assert_close(torch.tensor(logged_losses(a), dtype=torch.float64),
                               torch.tensor(logged_losses(b), dtype=torch.float64), rtol=rtol, atol=0)
    for site in {r["coords"].site for r in a}:
        pa, pb = merge_full_params(a, site=site), merge_full_params(b)
        for name in pb:
            torch.testing.assert_close(pa[name], pb[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_sites_of_dp_two_and_one_train_like_their_equal_equivalents(tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    argvs = {
        "dp3": COMMON + ["--lsgd-algorithm", "sync"],
        "sync": COMMON + UNEQUAL + ZERO1 + ["--lsgd-algorithm", "sync"],
        "three-sites": COMMON + ["--num-sites", "3"] + DILOCO,
        "diloco": COMMON + UNEQUAL + ZERO1 + DILOCO,
        "diloco-plain": COMMON + UNEQUAL + DILOCO,
        "paused": COMMON + UNEQUAL + ZERO1 + DILOCO + ["--save", ckpt, "--exit-interval", "3"],
        "resumed": COMMON + UNEQUAL + ZERO1 + DILOCO + ["--save", ckpt + "-end", "--load", ckpt],
    }
    runs = dict(zip(argvs, run_distributed_many(list(argvs.values()), 3, setup_module=twin_replica_data.MODULE)))
    losses = logged_losses(runs["dp3"])
    assert len(losses) == 6 and losses[-1] < losses[0], "the reference run should learn"
    for name in ("sync", "diloco", "diloco-plain", "resumed"):
        assert_replicas_identical(runs[name])  # every replica of both sites ends on the same model
    _assert_same_training(runs["sync"], runs["dp3"])
    _assert_same_training(runs["diloco"], runs["three-sites"])
    _assert_same_training(runs["diloco-plain"], runs["three-sites"])
    assert runs["diloco"][-1]["sync_stats"]["outer rounds"] == 3
    # the job counts its samples: 12 per step, 8 of them site 0's (4 per replica), 4 site 1's
    assert [r["consumed"] for r in runs["diloco"]] == [(72, 48), (72, 48), (72, 24)]
    # paused at 3, resumed from each site's own files: the uninterrupted run, bit for bit
    assert_resumed_per_site(runs["diloco"], runs["paused"], runs["resumed"], 3)
    _assert_converted_optimizer_state_resumes(ckpt, tmp_path, runs)


def _assert_converted_optimizer_state_resumes(ckpt: str, tmp_path, runs: dict) -> None:
    """tools/checkpoint/convert.py converts the diloco run paused at 3 (sites 2 + 1, ZeRO-1: site
    0's Adam moments and anchors lie in two shards, site 1's in one, each of buckets padded to
    L = 2 lanes), each site gathered with its own DP size.

    Oracles: (1) the by-parameter state read from the source equals, bit for bit and for every
    site, the one read back from its conversions to TP 1 and to TP 2 (the converter moves values;
    merging the TP 2 slices is the inverse of cutting them). (2) The TP 1 conversion resumed by
    sites 2 + 1 is the source's own resume bit for bit: loading places each parameter's values in
    this run's shards, and AdamW and the outer step are elementwise, so any value the gather put
    at a wrong parameter, lane or site would change the trajectory. (3) Resumed by equal sites of
    DP 1 (another batch split, so no bitwise trajectory to compare with): each site starts from
    its own saved model and at its share of the job's samples (36 / 2, not the 2:1 shares of
    the source), and the loaded optimizer state changes the training (a fresh one does not)."""
    source = by_parameter_state(ckpt)
    moments = [site[1]["torch/exp_avg"] for site in source]
    assert all(not torch.equal(moments[0][n], moments[1][n]) for n in moments[0]), "each site's own state"
    tp1, tp2 = convert_lsgd(ckpt, str(tmp_path / "tp1"), 1), convert_lsgd(ckpt, str(tmp_path / "tp2"), 2)
    assert_same_by_parameter_state(by_parameter_state(tp1), source, "TP 1")
    assert_same_by_parameter_state(by_parameter_state(tp2), source, "TP 2")
    with open(os.path.join(tp1, read_tracker(tp1), "metadata.json")) as f:
        args = json.load(f)["args"]  # the target's sites are of one size: no flag names the source's
    assert args["site_data_parallel_sizes"] is None and args["tensor_model_parallel_size"] == 1

    resumed = run_distributed_many([COMMON + UNEQUAL + ZERO1 + DILOCO + ["--load", tp1, "--no-load-rng"]], 3,
                                   setup_module=twin_replica_data.MODULE)[0]
    assert_resumed_per_site(runs["diloco"], runs["paused"], resumed, 3)

    equal = COMMON + ["--num-sites", "2"] + ZERO1 + DILOCO + ["--load", tp1, "--no-load-rng"]
    loaded, trained, fresh = run_distributed_many([equal + ["--train-iters", "3"], equal, equal + ["--no-load-optim"]],
                                                  2)
    for site in range(2):
        got, want = merge_full_params(loaded, site=site), merge_full_params(runs["paused"], site=site)
        assert all(torch.equal(got[n], want[n]) for n in want), f"site {site} loaded another model"
    assert [r["consumed"] for r in trained] == [(72, 36), (72, 36)]
    losses = logged_losses(trained)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert max(abs(a - b) for a, b in zip(losses, logged_losses(fresh))) > 1e-3, "the optimizer state was loaded"


@pytest.mark.slow
def test_unequal_sites_with_two_pipeline_stages():
    """Lanes and the loop's numbers per pipeline stage: sync on sites DP 2 + DP 1 (PP 2, 6 ranks)
    trains like one site of DP 3, diloco ends with every replica of both sites equal."""
    pp2 = COMMON + ["--pipeline-model-parallel-size", "2"] + ZERO1
    dp3, sync, diloco = run_distributed_many([pp2 + ["--lsgd-algorithm", "sync"], pp2 + UNEQUAL,
                                              pp2 + UNEQUAL + ["--lsgd-algorithm", "diloco", "--lsgd-interval", "2"]],
                                             6)
    assert_replicas_identical(sync)
    _assert_same_training(sync, dp3)
    assert_replicas_identical(diloco)
    assert diloco[-1]["sync_stats"]["outer rounds"] == 3


# streaming-diloco (H 4, K 2, tau 1, after one warm-up step): fragment 0's mean is in flight at
# the pause at 2 (started after local step 1, it lands at 2)
STREAMING = ["--lsgd-algorithm", "streaming-diloco", "--lsgd-interval", "4", "--lsgd-fragments", "2",
             "--lsgd-fragment-sync-delay", "1", "--lsgd-warmup-iters", "1"]
# cocodc on the same fragments, its adaptive choice with a fixed N (a measured N follows timing): N 4
# over 11 local steps, so which fragment goes follows the means' norms (a norm of 0 fails the test)
COCODC = ["--lsgd-algorithm", "cocodc", "--lsgd-interval", "4", "--lsgd-fragments", "2", "--lsgd-fragment-sync-delay",
          "1", "--lsgd-warmup-iters", "1", "--lsgd-cocodc-syncs-per-round", "4", "--train-iters", "12"]


@pytest.mark.slow
def test_fragment_means_of_sites_of_dp_two_and_one_train_like_their_equal_equivalents(tmp_path):
    """streaming-diloco with sites DP 2 + DP 1 == streaming-diloco on 3 sites of DP 1, on the twin
    data: the diloco oracle above, fragment by fragment. Sites 0 and 1 of the 3-site run stay
    bit-identical, so each fragment's mean is (Δ_a + Δ_a + Δ_b) / 3; site 0 of the 2-site run
    follows them exactly ((g + g) / 2 = g) and sends Δ_a, weighted 2/3, site 1 Δ_b weighted 1/3,
    lane by lane on the fragments' own groups; equal weights fail it. With and without ZeRO-1
    (without it site 0's replicas split each fragment at the lanes' places); paused with a
    fragment's mean in flight and resumed from each site's own files: bit for bit. cocodc the
    same (its delay compensation is elementwise; its choice of fragment reads the mean's norm,
    summed lane by lane so both sites choose alike); measuring its times, they ride in every
    lane and every rank of both sites takes the same schedule."""
    ckpt = str(tmp_path / "ckpt")
    argvs = {
        "three-sites": COMMON + ["--num-sites", "3"] + STREAMING,
        "streaming": COMMON + UNEQUAL + ZERO1 + STREAMING,
        "streaming-plain": COMMON + UNEQUAL + STREAMING,
        "paused": COMMON + UNEQUAL + ZERO1 + STREAMING + ["--save", ckpt, "--exit-interval", "2"],
        "resumed": COMMON + UNEQUAL + ZERO1 + STREAMING + ["--save", ckpt, "--load", ckpt],
        "cocodc-three-sites": COMMON + ["--num-sites", "3"] + COCODC,
        "cocodc": COMMON + UNEQUAL + ZERO1 + COCODC,
        "cocodc-plain": COMMON + UNEQUAL + COCODC,
        "cocodc-measured": COMMON + UNEQUAL + ZERO1 + COCODC + ["--lsgd-cocodc-syncs-per-round", "0"],
        "cocodc-paused": COMMON + UNEQUAL + ZERO1 + COCODC + ["--save", ckpt + "-c", "--exit-interval", "2"],
        "cocodc-resumed": COMMON + UNEQUAL + ZERO1 + COCODC + ["--save", ckpt + "-c", "--load", ckpt + "-c"],
    }
    runs = dict(zip(argvs, run_distributed_many(list(argvs.values()), 3, setup_module=twin_replica_data.MODULE)))
    for name, want in (("streaming", "three-sites"), ("streaming-plain", "three-sites"),
                       ("cocodc", "cocodc-three-sites"), ("cocodc-plain", "cocodc-three-sites")):
        assert runs[name][-1]["sync_stats"] == runs[want][-1]["sync_stats"]  # the same schedule
        assert_replicas_identical(runs[name])
        _assert_same_training(runs[name], runs[want])
    assert runs["cocodc-measured"][-1]["sync_stats"]["fragment syncs"] >= 3
    assert_replicas_identical(runs["cocodc-measured"])
    assert_resumed_per_site(runs["cocodc"], runs["cocodc-paused"], runs["cocodc-resumed"], 2)
    # fragment 0 after local steps 1 and 5 (landing in finish_training), fragment 1 after 3, and
    # fragment 1's closing sync
    assert runs["streaming"][-1]["sync_stats"]["fragment syncs"] == 4
    assert_resumed_per_site(runs["streaming"], runs["paused"], runs["resumed"], 2)


# dilocox (H 2, after one warm-up step): round 1's mean is in flight at the pause at 3
DILOCOX = ["--lsgd-algorithm", "dilocox", "--lsgd-interval", "2", "--lsgd-warmup-iters", "1"]
APPLY_STEP = ["--lsgd-dilocox-apply-step", "1"]  # the mean lands one step into the next round
INT4 = ["--lsgd-compression", "int4"]


@pytest.mark.slow
def test_the_one_round_late_mean_of_sites_of_dp_two_and_one_trains_like_its_equal_equivalent(tmp_path):
    """dilocox with sites DP 2 + DP 1 == dilocox on 3 sites of DP 1, on the twin data: the diloco
    oracle above, one round late (its eager restart θ_g − Δ and the mid-round application are
    elementwise, so site 0 still follows sites 0 and 1 of the 3-site run exactly). Uncompressed:
    compression is refused with such sites. With and without ZeRO-1, with the mean applied one
    step into the next round, with the adaptive H agreed on every lane (the run must not hang
    and must end on one model), and paused with a mean in flight and resumed: bit for bit."""
    ckpt = str(tmp_path / "ckpt")
    argvs = {
        "three-sites": COMMON + ["--num-sites", "3"] + DILOCOX,
        "dilocox": COMMON + UNEQUAL + ZERO1 + DILOCOX,
        "dilocox-plain": COMMON + UNEQUAL + DILOCOX,
        "three-sites-apply-step": COMMON + ["--num-sites", "3"] + DILOCOX + APPLY_STEP,
        "apply-step": COMMON + UNEQUAL + ZERO1 + DILOCOX + APPLY_STEP,
        "adaptive": COMMON + UNEQUAL + ZERO1 + DILOCOX + ["--lsgd-adaptive", "--lsgd-adaptive-h-max", "4"],
        "paused": COMMON + UNEQUAL + ZERO1 + DILOCOX + ["--save", ckpt, "--exit-interval", "3"],
        "resumed": COMMON + UNEQUAL + ZERO1 + DILOCOX + ["--save", ckpt, "--load", ckpt],
        "three-sites-int4": COMMON + ["--num-sites", "3"] + DILOCOX + INT4,
        "int4": COMMON + UNEQUAL + ZERO1 + DILOCOX + INT4,
        "int4-plain": COMMON + UNEQUAL + DILOCOX + INT4,
        "int4-paused": COMMON + UNEQUAL + ZERO1 + DILOCOX + INT4 + ["--save", ckpt + "-q", "--exit-interval", "3"],
        "int4-resumed": COMMON + UNEQUAL + ZERO1 + DILOCOX + INT4 + ["--save", ckpt + "-q", "--load", ckpt + "-q"],
    }
    runs = dict(zip(argvs, run_distributed_many(list(argvs.values()), 3, setup_module=twin_replica_data.MODULE)))
    for name, want in (("dilocox", "three-sites"), ("dilocox-plain", "three-sites"),
                       ("apply-step", "three-sites-apply-step")):
        assert runs[name][-1]["sync_stats"] == runs[want][-1]["sync_stats"]  # the same rounds
        assert_replicas_identical(runs[name])
        _assert_same_training(runs[name], runs[want])
    assert runs["dilocox"][-1]["sync_stats"]["outer rounds"] == 3
    assert_replicas_identical(runs["adaptive"])
    assert_resumed_per_site(runs["dilocox"], runs["paused"], runs["resumed"], 3)
    for name in ("int4", "int4-plain"):
        assert runs[name][-1]["sync_stats"]["outer rounds"] == 3
        _assert_compressed_like_equal_sites(runs, name, "three-sites-int4", "three-sites")
    assert_resumed_per_site(runs["int4"], runs["int4-paused"], runs["int4-resumed"], 3)


def _assert_compressed_like_equal_sites(runs: dict, name: str, compressed: str, exact: str) -> None:
    """Sites DP 2 + DP 1 compressing (a compressor per lane, SiteSplit.lane_compressors): each
    site sends C(w_s x S x Δ) per lane, so the mean is weighted, but not bit for bit the 3-site
    run's (`compressed`): quantizing is not linear, and the lanes' blocks start where the lanes
    do. So: one model on every replica, the losses of `compressed` to 1e-4, and its model to
    within 3x the compressor's own error there (its distance to the 3-site exact run `exact`;
    dilocox int4: measured 1.5x at most, equal weights 10x)."""
    assert_replicas_identical(runs[name])
    torch.testing.assert_close(torch.tensor(logged_losses(runs[name])),
                               torch.tensor(logged_losses(runs[compressed])), rtol=1e-4, atol=0)
    reference, fp32 = merge_full_params(runs[compressed]), merge_full_params(runs[exact])
    for key, got in merge_full_params(runs[name]).items():
        own_error = float((reference[key] - fp32[key]).abs().max())
        assert float((got - reference[key]).abs().max()) <= 3 * own_error, (name, key)
    assert runs[name][-1]["sync_stats"]["comp rel err"] > 0


INT8 = ["--lsgd-compression", "int8"]


@pytest.mark.slow
def test_compressed_means_of_sites_of_dp_two_and_one_follow_their_equal_equivalents(tmp_path):
    """diloco with int8, streaming-diloco and cocodc with int4, on sites DP 2 + DP 1 against
    the same on 3 sites of DP 1, on the twin data: as dilocox's int4 above, a compressor per
    lane (of each fragment), each site's contribution scaled by its weight
    (_assert_compressed_like_equal_sites). streaming-diloco with and without ZeRO-1 (without
    it site 0's replicas split each fragment at the lanes' places), and paused with a
    compressed fragment mean in flight and resumed from each site's files: bit for bit, the
    lanes' error feedback included. cocodc measuring its times: they ride exactly, weighted, in
    a collective of their own on every lane (a lane with none of a fragment too, and whatever
    the compressor), so every rank of both sites takes one schedule and ends on one model."""
    ckpt = str(tmp_path / "ckpt")
    three = ["--num-sites", "3"]
    argvs = {
        "diloco-three-sites": COMMON + three + DILOCO,
        "diloco-three-sites-int8": COMMON + three + DILOCO + INT8,
        "diloco-int8": COMMON + UNEQUAL + ZERO1 + DILOCO + INT8,
        "streaming-three-sites": COMMON + three + STREAMING,
        "streaming-three-sites-int4": COMMON + three + STREAMING + INT4,
        "streaming-int4": COMMON + UNEQUAL + ZERO1 + STREAMING + INT4,
        "streaming-int4-plain": COMMON + UNEQUAL + STREAMING + INT4,
        "paused": COMMON + UNEQUAL + ZERO1 + STREAMING + INT4 + ["--save", ckpt, "--exit-interval", "2"],
        "resumed": COMMON + UNEQUAL + ZERO1 + STREAMING + INT4 + ["--save", ckpt, "--load", ckpt],
        "cocodc-int4-measured": COMMON + UNEQUAL + ZERO1 + COCODC + INT4 + ["--lsgd-cocodc-syncs-per-round", "0"],
    }
    runs = dict(zip(argvs, run_distributed_many(list(argvs.values()), 3, setup_module=twin_replica_data.MODULE)))
    assert runs["diloco-int8"][-1]["sync_stats"]["outer rounds"] == 3
    _assert_compressed_like_equal_sites(runs, "diloco-int8", "diloco-three-sites-int8", "diloco-three-sites")
    for name in ("streaming-int4", "streaming-int4-plain"):
        assert runs[name][-1]["sync_stats"]["fragment syncs"] == 4
        _assert_compressed_like_equal_sites(runs, name, "streaming-three-sites-int4", "streaming-three-sites")
    assert_resumed_per_site(runs["streaming-int4"], runs["paused"], runs["resumed"], 2)
    assert runs["cocodc-int4-measured"][-1]["sync_stats"]["fragment syncs"] >= 3
    assert runs["cocodc-int4-measured"][-1]["sync_stats"]["comp rel err"] > 0
    assert_replicas_identical(runs["cocodc-int4-measured"])
