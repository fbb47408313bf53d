"""Sites of different tensor x pipeline layouts under the DiLoCo family (--site-tensor-model-parallel-sizes,
--site-pipeline-model-parallel-sizes; docs/heterogeneous_sites.md, core/lsgd/canonical_exchange.py).

- the layout: per-site coordinates, the lanes of the canonical form and their groups (pure);
- bad input and unsupported combinations: one error naming the flag (build_config), and one
  run in process for the exit code and the single `error:` line;
- training runs (spawned, gloo), diloco with a synchronous warm-up step, H 2, AdamW:
  * anchors identical across sites, bit for bit: a TP2 site beside a TP1 site, a TP2 x PP2
    site beside a TP1 site, and a TP2 site beside a TP1 site with two replicas each (with
    and without ZeRO-1), and a TP2 site of two replicas beside a TP1 site of one
    (--site-data-parallel-sizes 2,1: token-weighted means). Why exactly: the warm-up's gradients and each round's
    pseudo-gradients cross sites in the canonical form, where each value's mean is computed
    once, on one lane group, and every rank of both sites reads that one result; the outer
    step (torch's SGD) and AdamW are elementwise, so equal inputs give equal outputs on
    every site whatever the shard they sit in (no clipping: the gradient norm is summed in
    another order on each layout, so a clip factor could differ in its last bit);
  * a pause and resume (--exit-interval, --load) reproduces the uninterrupted TP2 + TP1 run bit
    for bit, each site from its own files in its own layout; convert.py converts every site's
    optimizer state (the oracles are _assert_converted_per_site's docstring);
  * equivalence: each of those runs trains like the same run on sites of TP1 (same seed, same
    data: a replica's samples follow its data-parallel index, which the layouts keep). The
    TP1 site computes the same thing in both runs; the TP2 / PP2 site's forward and backward
    sum the same products in another order (row-parallel partial sums added by an
    all-reduce), so its pseudo-gradient differs in the last bits of fp32, and so does the
    mean both sites take. Adam divides by sqrt(v), which turns a relative difference of a
    gradient into the same relative difference of its step (lr 2e-3), so parameters agree to
    atol 1e-5 (half a percent of one step; 2.3e-6 is seen) and losses to rtol 1e-5 (5e-7
    is seen). The run with sites of different sizes is compared with the same sizes at TP1
    (test_unequal_sites.py checks that run against its equal-sites equivalent).
- the rest of the family, whose means overlap inner steps (CanonicalExchange.issue / land on
  lanes of their own), in the same packed runs: dilocox (H 2; and tau 1), streaming-diloco (H 4, K 2,
  tau 1; also beside a TP2 x PP2 site) and cocodc (fixed N) on a TP2 site beside a TP1 site
  end on one anchor bit for bit (the same argument: one mean per value, read by all), take
  the same schedule as on TP1 sites and train like them within the bounds above, for the
  same reason (the TP2 site's arithmetic is the only difference; 8.6e-8 on the losses and
  3.7e-6 on the parameters are seen); a pause with a mean in flight and the resume are the
  uninterrupted run, bit for bit. cocodc measuring its times (a schedule that follows
  timing, so not compared with TP1) ends on one anchor; its times ride in every lane.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_lsgd.core.parallel_state import ParallelDims, enumerate_group_ranks
from megatron_lsgd.training.arguments import build_config, parse_args
from tests.unit_tests.harness import (assert_replicas_identical, assert_resumed_per_site,
                                     assert_same_by_parameter_state, by_parameter_state, convert_lsgd, logged_losses,
                                     merge_full_params, run_distributed_many)
from tests.unit_tests.training.test_arguments import BASE

TP, PP = "--site-tensor-model-parallel-sizes", "--site-pipeline-model-parallel-sizes"


# ---- layout --------------------------------------------------------------------------------------
def test_a_tp2_pp2_site_beside_a_tp1_site():
    d = ParallelDims.from_world(5, 1, 1, 2, None, [2, 1], [2, 1])
    assert d.mixed_layouts and d.world_size == 5 and d.dp_intra == 1 and d.dp == 2
    assert [d.ranks_of_site(s) for s in (0, 1)] == [4, 1] and d.site_start(1) == 4
    assert [(c.site, c.tp, c.pp) for c in map(d.coords, range(5))] == [(0, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1),
                                                                      (1, 0, 0)]
    for r in range(5):
        c = d.coords(r)
        assert d.rank_of(c.tp, c.dp_intra, c.pp, c.site) == r
    assert (d.for_site(0).tp, d.for_site(0).pp, d.for_site(1).tp, d.for_site(1).pp) == (2, 2, 1, 1)
    groups = enumerate_group_ranks(d)
    assert groups["tp"] == [(0, 1), (2, 3), (4,)] and groups["site"] == [(0, 1, 2, 3), (4,)]
    # L = lcm(4, 1) lanes of the canonical form: site 0's rank j holds lane j, site 1's rank all four
    assert d.lanes == 4 and groups["dp_inter"] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert groups["dp"] == [] and groups["last_stages"] == [(2, 3, 4)]
    assert d.vocab_tp == 2


def test_layouts_and_sizes_together():
    d = ParallelDims.from_world(5, 1, 1, 2, [2, 1], [2, 1])
    assert d.heterogeneous and d.site_dp == (2, 1) and d.dp == 3 and d.lanes == 4 and d.site_start(1) == 4
    assert enumerate_group_ranks(d)["dp_intra"] == [(0, 2), (1, 3), (4,)]


def test_replicas_and_lanes_with_two_replicas_per_site():
    d = ParallelDims.from_world(6, 1, 1, 2, None, [2, 1])
    assert d.dp_intra == 2 and d.site_pp == (1, 1) and d.lanes == 4 and d.lanes_of(1, 1) == [2, 3]
    assert enumerate_group_ranks(d)["dp_inter"] == [(0, 4), (1, 4), (2, 5), (3, 5)]


def test_one_layout_after_all_is_the_plain_layout():
    assert ParallelDims.from_world(4, 1, 1, 2, None, [2, 2]) == ParallelDims.from_world(4, 2, 1, 2)


class _PeerSite:
    """A comm whose lane means average with another site's buffers (one per lane group)."""

    def __init__(self, peer):
        self.peer, self.group = peer, None

    @contextlib.contextmanager
    def on_group(self, group):
        self.group = group
        yield self

    def all_reduce_mean(self, tensor, async_op=False):
        tensor.add_(self.peer[self.group]).mul_(0.5)
        return _Done()


class _Done:
    def is_completed(self):
        return True

    def wait(self):
        pass


def test_side_values_ride_in_every_lane_and_come_back_averaged():
    from megatron_lsgd.core.lsgd.canonical_exchange import CanonicalExchange
    from megatron_lsgd.core.lsgd.means import SideValues
    from megatron_lsgd.core.lsgd.reduction import run_blocking

    exchange = CanonicalExchange.__new__(CanonicalExchange)  # only its lanes matter here
    exchange.my_lanes = [(0, "lane 0"), (1, "lane 1")]
    peer = {"lane 0": torch.tensor([3.0, 5.0, 7.0, 9.0]), "lane 1": torch.tensor([1.0, 1.0, 7.0, 9.0])}
    side = SideValues(torch.tensor([1.0, 3.0]))
    means = run_blocking(exchange._lane_means(_PeerSite(peer), [torch.tensor([1.0, 1.0]), torch.tensor([3.0, 5.0])],
                                              side))
    assert [m.tolist() for m in means] == [[2.0, 3.0], [2.0, 3.0]] and side.mean.tolist() == [4.0, 6.0]


class _Tripling:
    """The other site sends three times this site's values: the mean is twice them."""

    @contextlib.contextmanager
    def on_group(self, group):
        yield self

    def all_reduce_mean(self, tensor, async_op=False):
        tensor.add_(tensor * 3).mul_(0.5)
        return _Done()


def test_canonical_positions_are_made_once_per_parameter_and_rounds_keep_their_means(monkeypatch):
    from types import SimpleNamespace

    from megatron_lsgd.core.lsgd.canonical_exchange import CanonicalExchange
    from megatron_lsgd.core.models.gpt.canonical_layout import CanonicalParam, canonical_units
    from megatron_lsgd.core.transformer.config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, padded_vocab_size=32,
                               seq_length=8)
    # a site of one rank (TP1 x PP1), two lanes: its exchange needs no group inside the site
    dims = SimpleNamespace(tp=1, pp=1, lanes=2, ranks_of_site=lambda site: 1)
    pgs = SimpleNamespace(dims=dims, site_rank=0, tp_rank=0, pp_rank=0, inter_lanes=[(0, "lane 0"), (1, "lane 1")])
    params = [p for u in canonical_units(config) for p in u.params]
    views = SimpleNamespace(
        pieces=[SimpleNamespace(name=p.name, p_lo=0, p_hi=p.numel, range_index=i, lo=0, hi=p.numel)
                for i, p in enumerate(params)],
        main=[torch.zeros(p.numel) for p in params])
    made = []
    local_index = CanonicalParam.local_index
    monkeypatch.setattr(CanonicalParam, "local_index", lambda self, *a: made.append(self.name) or local_index(self, *a))
    exchange = CanonicalExchange(pgs, config, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        tensors = [torch.randn(p.numel, generator=g) for p in params]
        means = exchange.mean(_Tripling(), views, tensors)
        again = CanonicalExchange(pgs, config, torch.device("cpu")).mean(_Tripling(), views, tensors)  # positions anew
        assert all(torch.equal(m, a) for m, a in zip(means, again))
        assert all(torch.equal(m, 2 * t) for m, t in zip(means, tensors))
    # the kept exchange made each parameter's positions once; each fresh one, once more
    assert sorted(made) == sorted(p.name for p in params for _ in range(3))


# ---- bad input -----------------------------------------------------------------------------------
def _config(extra, world):
    return build_config(parse_args(BASE + ["--num-sites", "2", "--global-batch-size", "4",
                                           "--lsgd-algorithm", "diloco"] + extra), world)


@pytest.mark.parametrize("extra,world,message", [
    ([TP, "2,1,1"], 3, f"{TP} 2,1,1 names 3 sites but --num-sites is 2"),
    ([PP, "2,0"], 3, f"{PP} 2,0: every site needs a size of at least 1"),
    ([TP, "2;1"], 3, f"{TP} '2;1': give one whole number per site"),
    ([TP, "2,1"], 4, "one replica on every site takes TP x PP = 2x1 + 1x1 = 3 ranks, which does not divide the "
                     "world of 4"),
    ([TP, "2,1", "--tensor-model-parallel-size", "2"], 3, f"{TP} 2,1 gives every site its own size: leave out "
                                                          f"--tensor-model-parallel-size 2"),
    ([TP, "3,1"], 4, "site 0's layout TP 3 x PP 1 cannot split the model: --num-attention-heads 4 is not "
                     "divisible by --tensor-model-parallel-size 3"),
    ([PP, "3,1"], 4, "site 0's layout TP 1 x PP 3 cannot split the model: --num-layers 2 is not divisible"),
    ([TP, "2,1", "--site-data-parallel-sizes", "1,2"], 3, "--site-data-parallel-sizes 1,2 with the sites' TP x PP "
                                                          "take 2 + 2 = 4 ranks, but the world has 3"),
    ([TP, "2,1", "--lsgd-compression", "int8"], 3, "cannot be combined with --lsgd-compression"),
    ([TP, "2,1", "--simulate-clock"], 3, "cannot be combined with --simulate-clock"),
    ([TP, "2,1", "--lsgd-fault-tolerance", "torchft", "--lsgd-site", "0"], 1,
     f"{TP} cannot be combined with --lsgd-fault-tolerance"),
])
def test_bad_layouts_and_unsupported_combinations_name_the_flag(extra, world, message):
    with pytest.raises(ValueError) as err:
        _config(extra, world)
    assert message in str(err.value), str(err.value)


@pytest.mark.parametrize("algorithm", ["sync", "edit", "a-edit", "dreamddp", "acco", "dpu"])
def test_every_other_algorithm_refuses_with_its_reason(algorithm):
    with pytest.raises(ValueError) as err:
        _config([TP, "2,1", "--lsgd-algorithm", algorithm, "--global-batch-size", "8"], 3)
    text = str(err.value)
    assert ("(sites of different layouts) is supported by --lsgd-algorithm cocodc, diloco, dilocox, "
            f"streaming-diloco only; {algorithm}: ") in text
    assert "\n" not in text


@pytest.mark.parametrize("algorithm", ["diloco", "dilocox", "streaming-diloco", "cocodc"])
def test_the_diloco_family_builds(algorithm):
    c = _config([TP, "2,1", PP, "2,1", "--lsgd-algorithm", algorithm, "--lsgd-interval", "4"], 5)
    assert c.dims.site_tp == (2, 1) and c.dims.site_pp == (2, 1) and c.num_microbatches == 1


def test_a_checkpoint_resumes_only_in_its_site_layouts():
    from megatron_lsgd.training.checkpointing.compat import check_site_layouts
    from megatron_lsgd.training.checkpointing.errors import CheckpointError

    mixed = ParallelDims.from_world(3, 1, 1, 2, None, [2, 1])
    saved = {"tp": 2, "pp": 1, "dp_intra": 1, "sites": 2, "site_tp": [2, 1], "site_pp": [1, 1]}
    check_site_layouts(saved, mixed, "ckpt")
    for dims, theirs in ((ParallelDims.from_world(3, 1, 1, 2, None, [1, 2]), saved),
                         (ParallelDims.from_world(4, 2, 1, 2), saved),
                         (mixed, {"tp": 2, "pp": 1, "dp_intra": 1, "sites": 2})):
        with pytest.raises(CheckpointError) as err:
            check_site_layouts(theirs, dims, "ckpt")
        assert "resume with the same --site-tensor-model-parallel-sizes" in str(err.value)


def test_a_bad_value_is_one_error_line(monkeypatch, capsys):
    from tests.unit_tests.checkpointing.single import run_single

    code = run_single(["--num-sites", "2", TP, "2,x"], monkeypatch)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and f"{TP} '2,x': give one whole number per site" in lines[-1]


# ---- training runs -------------------------------------------------------------------------------
COMMON = ["--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "6", "--lr", "2e-3",
          "--lr-decay-style", "constant", "--mock-data", "--vocab-size", "250", "--make-vocab-size-divisible-by", "32",
          "--log-interval", "1", "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
          "--seed", "7", "--adam-eps", "1e-6", "--clip-grad", "0", "--num-layers", "2", "--hidden-size", "64",
          "--num-attention-heads", "4", "--ddp-bucket-size", "5000", "--num-sites", "2",
          "--lsgd-algorithm", "diloco", "--lsgd-interval", "2", "--lsgd-warmup-iters", "1"]
ONE_REPLICA = COMMON + ["--global-batch-size", "4"]
TWO_REPLICAS = COMMON + ["--global-batch-size", "8"]
ZERO1 = ["--use-distributed-optimizer"]
# sites of different sizes too: a TP2 site of two replicas beside a TP1 site of one (weights 2/3, 1/3)
UNEQUAL = COMMON + ["--global-batch-size", "6", "--site-data-parallel-sizes", "2,1"] + ZERO1
# the rest of the family, whose means overlap inner steps: dilocox's one round late (H 2: the
# mean of round 1 is in flight at the pause at 3), streaming's fragments (H 4, K 2, tau 1:
# fragment 0's mean is in flight at the pause at 2; with PP 2 the first stage holds nothing of
# fragment 1 and still takes part), cocodc's with a fixed schedule (a measured one would
# follow timing, and the TP1 run could not be compared step for step)
DILOCOX = ONE_REPLICA + ["--lsgd-algorithm", "dilocox"]
APPLY_STEP = ["--lsgd-dilocox-apply-step", "1"]  # the mean lands one step into the next round
STREAMING = ONE_REPLICA + ["--lsgd-algorithm", "streaming-diloco", "--lsgd-interval", "4", "--lsgd-fragments", "2",
                           "--lsgd-fragment-sync-delay", "1"]
COCODC = ONE_REPLICA + ["--lsgd-algorithm", "cocodc", "--lsgd-interval", "4", "--lsgd-fragments", "2",
                        "--lsgd-fragment-sync-delay", "1", "--lsgd-cocodc-syncs-per-round", "2"]


def _assert_trains_like(run, reference):
    torch.testing.assert_close(torch.tensor(logged_losses(run), dtype=torch.float64),
                               torch.tensor(logged_losses(reference), dtype=torch.float64), rtol=1e-5, atol=0)
    got, want = merge_full_params(run, site=0), merge_full_params(reference)
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
def test_sites_of_different_layouts_end_on_one_anchor_and_train_like_tp1_sites(tmp_path, capsys):
    ckpt, ckpt_x, ckpt_s, ckpt_pp = (str(tmp_path / name) for name in ("ckpt", "ckpt-dilocox", "ckpt-streaming",
                                                                      "ckpt-pp"))

    def paused_and_resumed(argv, at, where):  # the resumed run saves elsewhere: `where` keeps the pause
        return [argv + [TP, "2,1", "--save", where, "--exit-interval", str(at)],
                argv + [TP, "2,1", "--save", where + "-end", "--load", where]]
    # the diloco pause resumed to iteration 4, an inner step: each site's own state, not yet mixed
    to4 = ["--no-load-rng", "--exit-interval", "4"]
    (tp2, paused, resumed, reference_unequal, x_tp2, x_paused, x_resumed, s_tp2, s_paused, s_resumed,
     c_tp2, c_measured, xa_tp2, source_to4) = run_distributed_many(
        [ONE_REPLICA + [TP, "2,1"]] + paused_and_resumed(ONE_REPLICA, 3, ckpt) + [UNEQUAL] +
        [DILOCOX + [TP, "2,1"]] + paused_and_resumed(DILOCOX, 3, ckpt_x) +
        [STREAMING + [TP, "2,1"]] + paused_and_resumed(STREAMING, 2, ckpt_s) + [COCODC + [TP, "2,1"]] +
        [COCODC + [TP, "2,1", "--lsgd-cocodc-syncs-per-round", "0"], DILOCOX + APPLY_STEP + [TP, "2,1"],
         ONE_REPLICA + [TP, "2,1", "--load", ckpt] + to4], 3)
    tp2_pp2, tp2_unequal, s_tp2_pp2, _, pp_source_to4 = run_distributed_many(
        [ONE_REPLICA + [TP, "2,1", PP, "2,1"], UNEQUAL + [TP, "2,1"], STREAMING + [TP, "2,1", PP, "2,1"],
         ONE_REPLICA + [TP, "2,1", PP, "2,1", "--save", ckpt_pp, "--exit-interval", "3"],
         ONE_REPLICA + [TP, "2,1", PP, "2,1", "--load", ckpt_pp] + to4], 5)
    tp1, tp2_all = convert_lsgd(ckpt, str(tmp_path / "tp1"), 1), convert_lsgd(ckpt, str(tmp_path / "tp2"), 2)
    pp_tp1 = convert_lsgd(ckpt_pp, str(tmp_path / "pp-tp1"), 1)
    pp_pp2 = convert_lsgd(ckpt_pp, str(tmp_path / "pp-pp2"), 1, 2)
    reference, x_reference, s_reference, c_reference, xa_reference, tp1_to4, pp_tp1_to4 = run_distributed_many(
        [ONE_REPLICA, DILOCOX, STREAMING, COCODC, DILOCOX + APPLY_STEP, ONE_REPLICA + ["--load", tp1] + to4,
         ONE_REPLICA + ["--load", pp_tp1] + to4], 2)
    reference_dp2, tp2_to4 = run_distributed_many(
        [TWO_REPLICAS + ZERO1, ONE_REPLICA + ["--tensor-model-parallel-size", "2", "--load", tp2_all] + to4], 4)
    zero1, plain = run_distributed_many([TWO_REPLICAS + [TP, "2,1"] + ZERO1, TWO_REPLICAS + [TP, "2,1"]], 6)
    assert logged_losses(reference)[-1] < logged_losses(reference)[0], "the reference run should learn"
    for run in (tp2, tp2_pp2, zero1, plain, tp2_unequal):
        assert run[-1]["sync_stats"]["outer rounds"] == 3
        assert_replicas_identical(run)  # every replica of both sites: the anchor, bit for bit
    _assert_trains_like(tp2, reference)
    _assert_trains_like(tp2_pp2, reference)
    _assert_trains_like(zero1, reference_dp2)
    _assert_trains_like(plain, reference_dp2)
    _assert_trains_like(tp2_unequal, reference_unequal)
    # paused at 3 and resumed, each site from its own files in its own layout: the uninterrupted run, bit for bit
    assert_resumed_per_site(tp2, paused, resumed, 3)
    # dilocox, streaming-diloco and cocodc: one anchor, bit for bit; like the same run on TP1 sites; resumed exactly
    assert x_tp2[-1]["sync_stats"]["outer rounds"] == 3
    for run, want in ((x_tp2, x_reference), (xa_tp2, xa_reference), (s_tp2, s_reference), (s_tp2_pp2, s_reference),
                      (c_tp2, c_reference)):
        assert run[-1]["sync_stats"] == want[-1]["sync_stats"]  # the same schedule: rounds, syncs
        assert_replicas_identical(run)
        _assert_trains_like(run, want)
    assert s_tp2[-1]["sync_stats"]["fragment syncs"] == 4  # 3 in the run, and fragment 0's last
    # cocodc measuring its times: they ride in every lane of the fragments' means (SideValues), so every
    # rank of both sites takes the same timing-driven schedule and the run ends on one anchor
    assert c_measured[-1]["sync_stats"]["fragment syncs"] >= 3
    assert_replicas_identical(c_measured)
    assert_resumed_per_site(x_tp2, x_paused, x_resumed, 3)
    assert_resumed_per_site(s_tp2, s_paused, s_resumed, 2)
    _assert_converted_per_site(ckpt, [tp1, tp2_all], source_to4, [(tp1_to4, 1), (tp2_to4, 0)])
    _assert_converted_per_site(ckpt_pp, [pp_tp1, pp_pp2], pp_source_to4, [(pp_tp1_to4, 1)])


def _assert_converted_per_site(ckpt, converted, source, resumed) -> None:
    """tools/checkpoint/convert.py converts the diloco pause at 3 of a TP 2 (x PP 2) site beside a
    TP 1 site (each site's files in its own layout) with every site's optimizer and
    synchronizer state. Oracles: (1) the by-parameter state read from the source equals, bit
    for bit and site by site, the one read back from each of its `converted` checkpoints (TP 1,
    TP 2, PP 2: values are moved, TP slices and stages cut and merged, nothing computed).
    (2) Iteration 4 is an inner step (rounds end at 3 and 5; --exit-interval does not close a
    round): each site steps alone, so a site resumed from the conversion in its source layout
    repeats the source's step exactly; `resumed` pairs each run with that site (on 2 sites of
    TP 1, site 1; on 2 sites of TP 2, site 0), which ends bit for bit on the source's model and
    anchor. A moment, step count or anchor gathered to the wrong parameter or site breaks it.
    The other site computes in another layout, so it agrees to the module's 1e-5."""
    source_state = by_parameter_state(ckpt)
    for where in converted:
        assert_same_by_parameter_state(by_parameter_state(where), source_state, where)
    for run, exact in resumed:
        for site in range(2):
            got, want = merge_full_params(run, site=site), merge_full_params(source, site=site)
            for name in want:
                if site == exact:
                    assert torch.equal(got[name], want[name]), (site, name)
                else:
                    torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)
        anchors = {(r["coords"].site, r["coords"].tp, r["coords"].pp): r["anchors"] for r in source}
        for rec in run:
            if rec["coords"].site == exact:
                want = anchors[(exact, rec["coords"].tp, rec["coords"].pp)]
                assert len(rec["anchors"]) == len(want) and all(map(torch.equal, rec["anchors"], want)), exact
