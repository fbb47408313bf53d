"""EDiT's pseudo-gradient penalty, A-EDiT's final-interval quotas and the non-lockstep stop
rule, as pure arithmetic (no processes); and the edit/a-edit flags' errors."""

import math

import pytest

from megatron_lsgd.core.lsgd.algorithms.edit.a_edit import allocate_quota
from megatron_lsgd.core.lsgd.algorithms.edit.edit import parse_faults
from megatron_lsgd.core.lsgd.algorithms.edit.penalty import Penalty, SiteStats, clip_coefficient, parse_parts, softmax_neg
from megatron_lsgd.core.lsgd.protocol import Meeting, Progress, stop_at_meeting
from megatron_lsgd.training.arguments import build_config, parse_args

ALL = frozenset({"anomaly", "weighted", "clip"})


@pytest.mark.parametrize("norms", [[1.0, 2.0, 3.0], [150.0, 151.0], [800.0, 800.0, 1e4], [0.0, math.inf, 5.0],
                                   [math.nan, 3.0], [1e-30, 2e-30]])
def test_softmax_weights_sum_to_one_and_never_underflow_to_all_flagged(norms):
    w = softmax_neg(norms)
    assert math.isclose(sum(w), 1.0, rel_tol=1e-12)
    assert all(x == 0.0 for x, g in zip(w, norms) if not math.isfinite(g))
    finite = [(x, g) for x, g in zip(w, norms) if math.isfinite(g)]
    assert max(finite, key=lambda t: t[0])[1] == min(g for _, g in finite)  # the smallest norm weighs most
    # softmax(-G) itself, where exp does not underflow
    if max(g for _, g in finite) < 50:
        z = sum(math.exp(-g) for _, g in finite)
        for x, g in finite:
            assert math.isclose(x, math.exp(-g) / z, rel_tol=1e-12)


def test_raw_norms_of_hundreds_keep_a_weight():
    # exp(-800) underflows to 0 in float64: computed naively both sites would look flagged.
    assert math.exp(-800.0) == 0.0
    w = softmax_neg([800.0, 801.0])
    assert math.isclose(w[0], 1 / (1 + math.exp(-1)), rel_tol=1e-12) and w[1] > 0


def test_ema_z_test_flags_after_warmup_and_keeps_flagged_out_of_the_statistics():
    p = Penalty(ALL, num_sites=2, delta=3.0, alpha=0.02, warmup=4)
    series = [1.0, 1.2, 0.9, 1.1]
    for g in series:  # warm-up: exact mean/variance, never flagged, even with an outlier in it
        assert p.decide("layers.0", [g, 50.0 if g == 1.0 else g]).flagged == [False, False]
    s0 = p.stats["layers.0"][0]
    assert s0.count == 4 and math.isclose(s0.mean, sum(series) / 4)
    assert math.isclose(s0.var, sum((g - s0.mean) ** 2 for g in series) / 4)
    before = (s0.count, s0.mean, s0.var)
    d = p.decide("layers.0", [100.0, 1.0])  # site 0 blows up
    assert d.flagged == [True, False] and d.weights == [0.0, 1.0] and not d.rollback
    assert (s0.count, s0.mean, s0.var) == before, "a flagged norm must not enter the EMA"
    # an ordinary observation updates the EMA: mu <- a G + (1 - a) mu, var <- (1 - a) var + a (G - mu_new)^2
    d = p.decide("layers.0", [1.05, 1.0])
    mu = 0.02 * 1.05 + 0.98 * before[1]
    assert d.flagged == [False, False] and math.isclose(s0.mean, mu)
    assert math.isclose(s0.var, 0.98 * before[2] + 0.02 * (1.05 - mu) ** 2)
    assert "layers.1" not in p.stats  # per unit


def test_every_site_flagged_is_a_rollback_and_non_finite_norms_are_flagged():
    p = Penalty(ALL, num_sites=3, warmup=2)
    for _ in range(2):
        p.decide("output", [1.0, 1.0, 1.0])
    d = p.decide("output", [1e3, math.inf, math.nan])
    assert d.flagged == [True, True, True] and d.rollback and d.weights == [0.0, 0.0, 0.0]
    # without the z-test, only non-finite norms are flagged; without weighting the rest share equally
    q = Penalty(frozenset({"anomaly", "clip"}) - {"anomaly"}, num_sites=3)
    assert not q.needs_norms and q.decide("output", []).weights == [1 / 3] * 3
    r = Penalty(frozenset({"anomaly"}), num_sites=3, warmup=1)
    r.decide("output", [1.0, 1.0, 1.0])
    d = r.decide("output", [1.0, 9.0, 1.0])
    assert d.flagged == [False, True, False] and d.weights == [0.5, 0.0, 0.5]


def test_detector_state_round_trips():
    p = Penalty(ALL, num_sites=2, warmup=1)
    p.decide("embedding", [1.0, 2.0])
    p.decide("embedding", [1.5, 2.5])
    q = Penalty(ALL, num_sites=2, warmup=1)
    q.load_state_dict(p.state_dict())
    assert q.stats == p.stats
    assert q.decide("embedding", [9.0, 2.4]) == p.decide("embedding", [9.0, 2.4])


def test_sigma_zero_flags_only_what_is_measurably_above():
    s = SiteStats(count=5, mean=2.0, var=0.0)
    assert not s.z_exceeds(2.0, 3.0) and not s.z_exceeds(2.0 + 1e-9, 3.0) and s.z_exceeds(2.1, 3.0)


def test_clip_coefficient():
    assert clip_coefficient(5.0, 10.0) == 1.0
    assert math.isclose(clip_coefficient(40.0, 10.0), 10.0 / (40.0 + 1e-6))
    assert clip_coefficient(0.0, 10.0) == 1.0


def test_quota_shares_the_remaining_steps_by_speed():
    assert allocate_quota(6, [4, 2]) == [4, 2]
    assert allocate_quota(3, [40, 1]) == [2, 1]  # at least one each
    assert allocate_quota(2, [5, 5]) == [1, 1]
    q = allocate_quota(101, [7, 3, 5])
    assert sum(q) == 101 and q[0] > q[2] > q[1]
    with pytest.raises(ValueError):
        allocate_quota(1, [3, 3])


def test_stop_rule_at_meetings():
    progress = Progress(iteration=5, site_samples=40, elapsed_s=1.0, train_iters=10, train_samples=None,
                        exit_duration_s=60.0, global_batch_size=16)
    assert stop_at_meeting(Meeting((6, 3), (48, 24)), progress) is None  # 72 of 160
    stop = stop_at_meeting(Meeting((12, 7), (96, 56)), progress)  # 152: less than a global batch left
    assert stop.ends_training and "--train-iters" in stop.reason and "12/7" in stop.reason
    pause = stop_at_meeting(Meeting((6, 3), (48, 24), time_up=True), progress)
    assert not pause.ends_training and "--exit-duration-in-mins" in pause.reason
    budget = Progress(5, 40, 1.0, 10, 100, None, 16)
    assert stop_at_meeting(Meeting((6, 5), (48, 40)), budget).ends_training  # 88: 12 left < 16
    assert "--train-samples" in stop_at_meeting(Meeting((6, 5), (48, 40)), budget).reason


def test_parsers():
    assert parse_parts("anomaly, clip") == {"anomaly", "clip"} and parse_parts("none") == frozenset()
    with pytest.raises(ValueError, match="--lsgd-edit-penalty"):
        parse_parts("anomaly,clipping")
    assert parse_faults("1:5:100,all:7:1e6", 2) == [(1, 5, 100.0), (None, 7, 1e6)]
    for bad in ("2:5:10", "1:0:10", "1:5", "x:1:2", "0:1:-3"):
        with pytest.raises(ValueError, match="--lsgd-edit-inject-fault"):
            parse_faults(bad, 2)


BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "1", "--train-iters", "10", "--lr", "1e-3", "--mock-data", "--vocab-size", "100",
        "--num-sites", "2"]


@pytest.mark.parametrize("extra,message", [
    (["--lsgd-algorithm", "edit", "--lsgd-edit-prefetch", "-1"], "--lsgd-edit-prefetch"),
    (["--lsgd-algorithm", "edit", "--lsgd-edit-penalty", "weights"], "--lsgd-edit-penalty"),
    (["--lsgd-algorithm", "edit", "--lsgd-edit-z-threshold", "0"], "--lsgd-edit-z-threshold"),
    (["--lsgd-algorithm", "edit", "--lsgd-edit-ema-alpha", "1.5"], "--lsgd-edit-ema-alpha"),
    (["--lsgd-algorithm", "edit", "--lsgd-edit-ema-warmup", "0"], "--lsgd-edit-ema-warmup"),
    (["--lsgd-algorithm", "edit", "--lsgd-edit-clip", "0"], "--lsgd-edit-clip"),
    (["--lsgd-algorithm", "edit", "--lsgd-edit-penalty", "weighted", "--lsgd-edit-clip", "5"],
     "--lsgd-edit-clip needs 'clip'"),
    (["--lsgd-algorithm", "edit", "--lsgd-edit-penalty", "clip", "--lsgd-edit-z-threshold", "2"],
     "--lsgd-edit-z-threshold needs 'anomaly'"),
    (["--lsgd-algorithm", "edit", "--lsgd-edit-inject-fault", "5:1:10"], "--lsgd-edit-inject-fault"),
    (["--lsgd-algorithm", "edit", "--lsgd-edit-norms", "per-step", "--lsgd-edit-penalty", "clip"],
     "--lsgd-edit-norms needs"),
    (["--lsgd-algorithm", "edit", "--lsgd-compression", "int4", "--pipeline-model-parallel-size", "2"],
     "--untie-embeddings-and-output-weights"),
    (["--lsgd-algorithm", "a-edit", "--lsgd-aedit-interval-seconds", "0"], "--lsgd-aedit-interval-seconds"),
    (["--lsgd-algorithm", "a-edit", "--lsgd-interval", "5"], "--lsgd-interval does not apply"),
    (["--lsgd-algorithm", "a-edit", "--rampup-batch-size", "2", "2", "8"],
     "--rampup-batch-size with --lsgd-algorithm a-edit"),
    (["--lsgd-algorithm", "edit", "--lsgd-aedit-interval-seconds", "5"],
     "--lsgd-aedit-interval-seconds needs --lsgd-algorithm a-edit"),
    (["--lsgd-algorithm", "diloco", "--lsgd-edit-prefetch", "2"], "--lsgd-edit-prefetch needs --lsgd-algorithm"),
])
def test_bad_flags_name_the_flag(extra, message):
    with pytest.raises(ValueError, match=message):
        build_config(parse_args(BASE + extra), 4 if "--pipeline-model-parallel-size" in extra else 2)


def test_a_edit_takes_the_edit_flags_and_needs_two_sites():
    cfg = build_config(parse_args(BASE + ["--lsgd-algorithm", "a-edit", "--lsgd-edit-prefetch", "2",
                                          "--lsgd-aedit-interval-seconds", "30", "--lsgd-compression", "int8"]), 2)
    assert cfg.lsgd.algo.prefetch == 2 and cfg.lsgd.algo.interval_seconds == 30 and cfg.lsgd.compression.kind == "int8"
    with pytest.raises(ValueError, match="--num-sites"):
        build_config(parse_args(BASE[:-2] + ["--lsgd-algorithm", "a-edit"]), 1)
    # tied embeddings with PP > 1 are fine uncompressed, and untied with compression
    build_config(parse_args(BASE + ["--lsgd-algorithm", "edit", "--pipeline-model-parallel-size", "2"]), 4)
    build_config(parse_args(BASE + ["--lsgd-algorithm", "edit", "--pipeline-model-parallel-size", "2",
                                    "--untie-embeddings-and-output-weights", "--lsgd-compression", "int4"]), 4)
