"""DiLoCo / DiLoCoX round logic on a fake one-site context (no processes): which mean an
outer step applies, warm-up, restart from the anchor, weights_only state round trip."""

import io

import pytest
import torch

from megatron_lsgd.core.lsgd.config import OuterOptions
from megatron_lsgd.core.lsgd.algorithms.diloco import DiLoCo
from megatron_lsgd.core.lsgd.algorithms.dilocox import DiLoCoX
from megatron_lsgd.core.lsgd.outer_state import OuterState
from tests.unit_tests.lsgd.fakes import active, lsgd_config, make_context, whole_views


def run_rounds(sync, rounds, h, drift, restart_check=True):
    """Each inner step moves the local shard by -drift(round); returns anchors after each round."""
    shard = sync.ctx.optimizer.shards[0]
    anchors, it = [], sync.ctx.config.rounds.warmup_iters
    for r in range(rounds):
        for _ in range(h):
            sync.before_forward_backward(it)
            shard -= drift(r)
            sync.after_optimizer_step(it, True)
            it += 1
        anchors.append(sync.outer.anchors[0].clone())
        if restart_check:
            assert torch.equal(shard, anchors[-1]), "locals restart from the anchor"
    return anchors


@pytest.mark.parametrize("restart", ["anchor", "eager"])
def test_dilocox_round1_applies_nothing_round_k_applies_round_k_minus_1(restart):
    cfg = lsgd_config("dilocox", interval=3, outer_lr=1.0, outer_momentum=0.0, restart=restart)
    sync = active(DiLoCoX(make_context(cfg, [torch.zeros(6)])))
    drift = lambda r: float(r + 1)  # noqa: E731  round r's pseudo-gradient is 3 (r + 1)
    anchors = run_rounds(sync, 4, 3, drift, restart_check=restart == "anchor")
    if restart == "eager":  # one site, lr 1: the local run continues as if never interrupted
        torch.testing.assert_close(sync.ctx.optimizer.shards[0], torch.full((6,), -3.0 * (1 + 2 + 3 + 4)))
    assert torch.equal(anchors[0], torch.zeros(6))  # round 1 applies nothing
    expected = torch.zeros(6)
    for k in range(1, 4):
        expected = expected - 3.0 * k  # round k+1 applies round k's mean Δ = 3k (outer lr 1)
        torch.testing.assert_close(anchors[k], expected)
    assert sync.applied_rounds == [-1, 0, 1, 2]


@pytest.mark.parametrize("restart", ["anchor", "eager"])
def test_dilocox_finish_training_applies_the_last_mean_and_a_partial_round(restart):
    cfg = lsgd_config("dilocox", interval=3, outer_lr=1.0, outer_momentum=0.0, restart=restart)
    sync = active(DiLoCoX(make_context(cfg, [torch.zeros(6)])))
    shard = sync.ctx.optimizer.shards[0]
    run_rounds(sync, 2, 3, lambda r: 1.0, restart_check=False)  # round 2's mean still in flight
    for it in range(2):  # two steps of a third round, then --train-iters is reached
        sync.before_forward_backward(6 + it)
        shard -= 1.0
        sync.after_optimizer_step(6 + it, True)
    sync.finish_training(8)
    # one site, lr 1: every round's progress is in the anchor, and the model is the anchor
    torch.testing.assert_close(sync.outer.anchors[0], torch.full((6,), -8.0))
    assert torch.equal(shard, sync.outer.anchors[0])
    assert sync.applied_rounds == [-1, 0, 1, 2] and sync.pending is None and sync.outer_rounds == 3
    sync.finish_training(8)  # idempotent: nothing left to apply
    assert sync.applied_rounds == [-1, 0, 1, 2]


@pytest.mark.parametrize("restart", ["anchor", "eager"])
def test_dilocox_apply_step_applies_the_mean_tau_steps_into_the_next_round(restart):
    cfg = lsgd_config("dilocox", interval=3, outer_lr=1.0, outer_momentum=0.0, restart=restart,
                     apply_step=1)
    sync = active(DiLoCoX(make_context(cfg, [torch.zeros(2)])))
    shard = sync.ctx.optimizer.shards[0]
    trace = []
    for it in range(9):  # 3 rounds; every step moves the shard by -1
        sync.before_forward_backward(it)
        shard -= 1.0
        sync.after_optimizer_step(it, True)
        trace.append((float(shard[0]), float(sync.outer.anchors[0][0])))
    # round 1 applies nothing; round k's mean (3) lands after the first step of round k + 1
    assert [a for _, a in trace] == [0, 0, 0, -3, -3, -3, -6, -6, -6]
    assert sync.applied_rounds == [-1, 0, 1]
    if restart == "eager":  # one site: the local run never notices
        assert [x for x, _ in trace] == [-1, -2, -3, -4, -5, -6, -7, -8, -9]
    else:  # restarted at the anchor (0, then -3), then moved with it by the applied mean
        assert [x for x, _ in trace] == [-1, -2, 0, -4, -5, -3, -7, -8, -6]
    sync.finish_training(9)
    torch.testing.assert_close(sync.outer.anchors[0], torch.full((2,), -9.0))


def test_diloco_finish_training_closes_a_partial_round():
    cfg = lsgd_config("diloco", interval=4, outer_lr=1.0, outer_momentum=0.0)
    sync = active(DiLoCo(make_context(cfg, [torch.zeros(3)])))
    shard = sync.ctx.optimizer.shards[0]
    sync.finish_training(0)  # nothing run yet: nothing to do
    assert sync.outer_rounds == 0
    for it in range(6):
        shard -= 0.5
        sync.after_optimizer_step(it, True)
    sync.finish_training(6)
    assert sync.outer_rounds == 2 and sync.steps_in_round == 0
    torch.testing.assert_close(sync.outer.anchors[0], torch.full((3,), -3.0))


def test_diloco_applies_its_own_round_immediately_and_warmup_is_synchronous():
    cfg = lsgd_config("diloco", interval=2, outer_lr=1.0, outer_momentum=0.0, warmup_iters=3)
    sync = active(DiLoCo(make_context(cfg, [torch.zeros(4)])))
    shard = sync.ctx.optimizer.shards[0]
    for it in range(3):  # warm-up: nothing happens to the shard, anchor taken at the end
        shard -= 1.0
        sync.after_optimizer_step(it, True)
    assert torch.equal(sync.outer.anchors[0], torch.full((4,), -3.0))
    anchors = run_rounds(sync, 2, 2, lambda r: 1.0)
    torch.testing.assert_close(anchors[0], torch.full((4,), -5.0))
    torch.testing.assert_close(anchors[1], torch.full((4,), -7.0))


def test_outer_nesterov_matches_formula():
    shard = [torch.zeros(3)]
    outer, views = OuterState(shard, OuterOptions(lr=0.5, momentum=0.9)), whole_views(shard)
    g1, g2 = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([-1.0, 0.5, 0.0])
    outer.step(views, [g1])
    buf = g1.clone()
    expected = -0.5 * (g1 + 0.9 * buf)
    torch.testing.assert_close(outer.anchors[0], expected)
    outer.step(views, [g2])
    buf = 0.9 * buf + g2
    expected = expected - 0.5 * (g2 + 0.9 * buf)
    torch.testing.assert_close(outer.anchors[0], expected)


def _roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("compression,rank", [("none", 0), ("int4", 0), ("lowrank-int4", 2)])
def test_dilocox_state_dict_is_complete_and_weights_only(compression, rank):
    layout = [[((8, 6), 0, 48, 0, 48)]]
    # Adaptive state travels too (the timing-free rule keeps both runs deterministic).
    block = {"quant_block": 16} if compression != "none" else {}  # refused without a compression
    cfg = lsgd_config("dilocox", interval=2, compression=compression, rank=rank, **block,
                     adaptive=rank > 0, adaptive_h_rule="scale-with-rank", outer_offload=True)

    def build():
        return active(DiLoCoX(make_context(cfg, [torch.zeros(48)], layout)))

    a, b = build(), build()
    g = torch.Generator().manual_seed(0)
    drifts = [torch.randn(48, generator=g) * 0.1 for _ in range(4)]
    run_rounds(a, 2, 2, lambda r: drifts[r], False)  # leaves round 2's mean pending
    with pytest.raises(RuntimeError, match="call quiesce"):  # state_dict() reads, it does not finish work
        a.state_dict()
    a.quiesce()  # as the checkpoint does
    b.load_state_dict(_roundtrip(a.state_dict()))
    b.ctx.optimizer.shards[0].copy_(a.ctx.optimizer.shards[0])
    ra = run_rounds(a, 2, a.interval, lambda r: drifts[2 + r], False)
    rb = run_rounds(b, 2, b.interval, lambda r: drifts[2 + r], False)
    assert torch.equal(a.ctx.optimizer.shards[0], b.ctx.optimizer.shards[0])
    for x, y in zip(ra, rb):
        assert torch.equal(x, y)
    assert a.applied_rounds == b.applied_rounds == [-1, 0, 1, 2]


def test_diloco_state_dict_weights_only():
    cfg = lsgd_config("diloco", interval=2, outer_momentum=0.9)
    a = active(DiLoCo(make_context(cfg, [torch.zeros(5)])))
    run_rounds(a, 2, 2, lambda r: 0.3)
    b = active(DiLoCo(make_context(cfg, [torch.zeros(5)])))
    b.load_state_dict(_roundtrip(a.state_dict()))
    assert torch.equal(b.outer.anchors[0], a.outer.anchors[0])
    assert b.outer.momentum_norm() == a.outer.momentum_norm() > 0
    assert b.outer_rounds == 2


def test_adaptive_rules():
    layout = [[((64, 32), 0, 2048, 0, 2048)]]
    cfg = lsgd_config("dilocox", interval=4, compression="lowrank-int4", rank=8, adaptive=True,
                     adaptive_window=2, adaptive_min_rank=2, adaptive_h_slack=1.0)
    sync = active(DiLoCoX(make_context(cfg, [torch.zeros(2048)], layout)))
    # hide-comm: 4 steps of 10 ms hide 25 ms of transfer -> smallest H is 3, clamped to h-min 4;
    # 100 ms of transfer needs 10 steps; h-max (16) caps 1 s.
    for comm_s, expected_h in ((0.025, 4), (0.1, 10), (1.0, 16)):
        sync._round_compute, sync._comm_seconds, sync.interval = 0.04, comm_s, 4
        sync._adapt()
        assert sync.interval == expected_h, comm_s
    # rank: mean of the last 2 effective ranks, clamped to [min rank, --lsgd-rank]
    sync.compressor.last_effective_ranks = [3, 1]
    sync._adapt()
    assert sync.compressor.rank == 3
    sync.compressor.last_effective_ranks = [1]
    sync._adapt()
    assert sync.compressor.rank == 2  # ceil(mean(3, 1))
    sync.compressor.last_effective_ranks = [1]
    sync._adapt()
    assert sync.compressor.rank == 2  # min rank
    assert sync.compressor.qs[0].shape == (32, 8)  # warm start keeps its full width for regrowth
