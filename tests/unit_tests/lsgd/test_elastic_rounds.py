"""Elastic rounds of dilocox, streaming-diloco and cocodc without processes: the real
TorchftMembership round logic (start, finish, undo, the quorum guard) over a scripted
torchft Manager whose `should_commit` says no at chosen decisions, on one-site fakes whose
compressors still quantize, sparsify or factor (and so keep error feedback).

What a multi-site job shows with real processes (test_fault_tolerance_pretrain.py) is
shown here for every compressor: without failures the elastic rounds give the plain run's
numbers bit for bit; a mean that does not commit moves no anchor, puts the error feedback
back as it was when the mean was issued, loses no local progress (dilocox sends it again;
a streaming fragment restarts from its anchor and is retried), and the state right after
the rollback resumes exactly (what a checkpoint or a heal carries is complete).
"""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest
import torch

from megatron_lsgd.core.clock import Clock
from megatron_lsgd.core.lsgd.algorithms.cocodc import CoCoDC
from megatron_lsgd.core.lsgd.comm import InterSiteTimeout
from megatron_lsgd.core.lsgd.algorithms.dilocox import DiLoCoX
from megatron_lsgd.core.lsgd.membership import Finished, Heal
from megatron_lsgd.core.lsgd.algorithms.streaming import StreamingDiLoCo
from tests.unit_tests.checkpointing.launch import assert_same
from tests.unit_tests.lsgd.fakes import active, lsgd_config, make_context, scripted_membership
from tests.unit_tests.lsgd.test_streaming import active as active_streaming
from tests.unit_tests.lsgd.test_streaming import fragment_context

COMPRESSIONS = [("int4", {}), ("int8", {}), ("lowrank-int4", {"rank": 2}), ("topk-2bit", {})]


def _roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ---- dilocox -------------------------------------------------------------------------------------
def _dilocox(compression="none", membership=None, numel=48, **kw):
    layout = [[((8, 6), 0, 48, 0, 48)]] if numel == 48 else None
    block = {"quant_block": 16} if compression in ("int4", "int8", "lowrank-int4") else {}
    cfg = lsgd_config("dilocox", interval=2, compression=compression, **block, **kw)
    ctx = make_context(cfg, [torch.zeros(numel)], layout)
    if membership is not None:
        ctx.membership = membership
    return active(DiLoCoX(ctx))


def _steps(sync, drifts, first=0, before_each=None):
    """One inner step per drift (the shard moves by -drift); returns the anchor after each step."""
    shard, anchors = sync.ctx.optimizer.shards[0], []
    for i, d in enumerate(drifts):
        if before_each is not None:
            before_each(first + i)
        sync.before_forward_backward(first + i)
        shard -= d
        sync.after_optimizer_step(first + i, True)
        anchors.append(sync.outer.anchors[0].clone())
    return anchors


@pytest.mark.parametrize("restart", ["eager", "anchor"])
def test_dilocox_a_mean_that_does_not_commit_is_sent_again_with_the_next(restart):
    # One site, outer lr 1, no momentum, exact values: an applied mean moves the anchor by the
    # whole pseudo-gradient. Round 1 is a decision alone (nothing to send: decision 0); the
    # mean of round 1 (issued after round 2's quorum, decided at round 2's end: decision 1)
    # fails; round 3 sends rounds 1 and 2's progress together.
    m = scripted_membership(fail={1})
    sync = _dilocox(membership=m, numel=4, outer_lr=1.0, outer_momentum=0.0, restart=restart)
    anchors = _steps(sync, [1.0] * 8)
    assert [float(a[0]) for a in anchors] == [0, 0, 0, 0, 0, -4, 0 - 4, -6]  # round 1's mean never lands
    assert sync.applied_rounds == [-1, 1, 2]
    assert m.manager.quorums == 4 and m.lines and "round 2 was not committed" in m.lines[0]
    sync.finish_training(8)  # the last round's mean, in a round of its own
    assert torch.equal(sync.outer.anchors[0], torch.full((4,), -8.0))  # nothing lost, nothing twice
    assert torch.equal(sync.ctx.optimizer.shards[0], sync.outer.anchors[0]) and not sync.finishing
    assert m.manager.quorums == 5 and m._open is None


def test_rounds_that_never_commit_stop_the_site_with_one_error_line():
    # The H200's gpu_check (2026-11-28): two sites on one GPU under NCCL failed every round
    # ("invalid usage"); a dilocox site rolled back 936 rounds in 5 minutes, trained apart, and
    # retried its closing exchange until the check killed it. Past --lsgd-ft-max-failed-rounds
    # the site raises what the loop prints as its one error line (exit code 2).
    m = scripted_membership(fail=set(range(1, 1000)))
    m.options.max_failed_rounds = 3
    sync = _dilocox(membership=m, numel=4, outer_lr=1.0, outer_momentum=0.0)
    _steps(sync, [1.0] * 6)
    assert m.failed_in_a_row == 2 and m.rounds_committed == 1
    with pytest.raises(InterSiteTimeout, match=r"site 0: 3 rounds in a row were not committed \(the last: a peer "
                                               r"site did not commit\); .*--lsgd-ft-max-failed-rounds 3$"):
        sync.finish_training(6)  # the closing exchange retries until a round commits: not forever


def test_a_committed_round_restarts_the_count_of_failed_ones():
    m = scripted_membership(fail={1, 2, 4, 5, 7, 8})
    m.options.max_failed_rounds = 3
    sync = _dilocox(membership=m, numel=4, outer_lr=1.0, outer_momentum=0.0)
    _steps(sync, [1.0] * 20)
    sync.finish_training(20)
    assert m.rounds_committed == 5 and m.failed_in_a_row == 0  # two in a row at most: never stopped


@pytest.mark.parametrize("compression,extra", COMPRESSIONS + [("none", {})], ids=lambda v: str(v))
def test_dilocox_elastic_rounds_without_failures_equal_the_plain_run(compression, extra):
    g = torch.Generator().manual_seed(1)
    drifts = [torch.randn(48, generator=g) * 0.1 for _ in range(9)]
    plain, elastic = _dilocox(compression, **extra), _dilocox(compression, scripted_membership(), **extra)
    for sync in (plain, elastic):
        _steps(sync, drifts)
        sync.finish_training(9)
    assert torch.equal(plain.outer.anchors[0], elastic.outer.anchors[0])
    assert torch.equal(plain.ctx.optimizer.shards[0], elastic.ctx.optimizer.shards[0])
    assert_same(elastic.state_dict(), plain.state_dict())
    assert plain.applied_rounds == elastic.applied_rounds


@pytest.mark.parametrize("compression,extra", COMPRESSIONS, ids=lambda v: str(v))
@pytest.mark.parametrize("apply_step", [0, 1])
def test_dilocox_rollback_puts_back_the_error_feedback_and_resumes_exactly(compression, extra, apply_step):
    # Decision 2 (round 2's mean, issued at round 3's first step) fails.
    g = torch.Generator().manual_seed(2)
    drifts = [torch.randn(48, generator=g) * 0.1 for _ in range(10)]
    m = scripted_membership(fail={2})
    sync = _dilocox(compression, m, apply_step=apply_step, **extra)
    seen = {}

    def before(i):
        if i == 4:  # round 3's first step: the failing mean is issued after its quorum
            seen["compressor"] = _roundtrip(sync.compressor.state_dict())
            seen["outer"] = _roundtrip(sync.outer.state_dict())

    _steps(sync, drifts[:6], before_each=before)  # rounds 1-3: round 2's mean failed
    assert m.manager.decisions == 3 and m.rounds_committed == 2
    assert_same(sync.outer.state_dict(), seen["outer"])  # no outer step, no momentum change
    assert_same(sync.compressor.state_dict(), seen["compressor"])  # error feedback as at the issue
    assert sync.outgoing is not None and sync.carry is None  # round 2's Δ goes again with round 3's
    resumed = _dilocox(compression, scripted_membership(), apply_step=apply_step, **extra)
    resumed.load_state_dict(_roundtrip(sync.state_dict()))
    resumed.ctx.optimizer.shards[0].copy_(sync.ctx.optimizer.shards[0])
    a = _steps(sync, drifts[6:], first=6)
    b = _steps(resumed, drifts[6:], first=6)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    for s in (sync, resumed):
        s.finish_training(10)
    assert_same(sync.state_dict(), resumed.state_dict())
    assert torch.equal(sync.ctx.optimizer.shards[0], resumed.ctx.optimizer.shards[0])


def test_dilocox_final_exchange_is_retried_until_it_commits():
    # H = 2, 4 steps: decisions 0 (round 1) and 1 (round 1's mean) commit, 2 (round 2's
    # mean, at the end) fails once.
    m = scripted_membership(fail={2})
    sync = _dilocox(membership=m, numel=4, outer_lr=1.0, outer_momentum=0.0)
    _steps(sync, [1.0] * 4)
    sync.finish_training(4)
    assert torch.equal(sync.outer.anchors[0], torch.full((4,), -4.0)) and m.manager.decisions == 4


class _Step:
    """The parts of an inner step, recorded (a step that ended training computes nothing)."""

    num_microbatches = 1

    def __init__(self):
        self.parts = []

    def __getattr__(self, name):
        if name in ("zero_grads", "compute_grads", "reduce_in_site", "apply"):
            return lambda *a, **k: self.parts.append(name) or ((True, None) if name == "apply" else [])
        raise AttributeError(name)


def _serve_first_closing_quorum(peer, model):
    """Run the peer's finish_training and return what torchft serves a healing site at the
    quorum of its first closing exchange: the peer's synchronizer state and model (copies)."""
    served, peer_quorum = {}, peer.ctx.membership.round_started

    def serve():
        heal = peer_quorum()
        if not served:
            served.update(sync=_roundtrip(peer.state_dict()), model=model(peer).clone())
        return heal

    peer.ctx.membership.round_started = serve
    peer.finish_training(0)
    return served


def _healed_at_first_quorum(site, served, model):
    """Its first quorum brings `served` (what torchft's heal loads), as a Heal."""
    m = site.ctx.membership
    own_quorum = m.round_started

    def heal():
        if m.heals:
            return own_quorum()
        m._received = {"rounds_attempted": 0, "rounds_committed": 0, "finished": False}  # as torchft loads it
        site.load_state_dict(served["sync"])
        model(site).copy_(served["model"])
        return own_quorum()

    m.round_started = heal


CLOSING = ["dilocox", "streaming", "cocodc-rr", "cocodc-dense"]


@pytest.mark.parametrize("algorithm", CLOSING)
def test_a_site_healed_into_the_closing_exchanges_finishes_them_and_ends_through_the_protocol(algorithm):
    # What a site receives at the quorum of a peer's first closing exchange (the peer's state,
    # model included, `finishing` in it) makes it take part in the rest of them (the one
    # end-of-training loop, membership.close_exchanges) and end with the peer's model. Its
    # training then ends through the protocol: train_step returns at once with
    # StepResult.ended (nothing computed), no exception (issue 49: once JobFinished).
    if algorithm == "dilocox":
        def make():
            return _dilocox(membership=scripted_membership(), numel=4, outer_lr=1.0, outer_momentum=0.0)

        def model(sync):
            return sync.ctx.optimizer.shards[0]
        moves, steps = [1.0] * 4, _steps
    else:
        cls, algo = dict(zip(STREAMING_IDS, STREAMING))[algorithm]

        def make():
            return _streaming(cls, "int8", scripted_membership(), **algo)

        def model(sync):
            return sync.ctx.optimizer.shard
        g = torch.Generator().manual_seed(5)
        moves, steps = [torch.randn(48, generator=g) * 0.1 for _ in range(7)], _fragment_steps
    peer = make()
    steps(peer, moves)
    served = _serve_first_closing_quorum(peer, model)
    assert served["sync"]["finishing"] == 1
    healed = make()
    _healed_at_first_quorum(healed, served, model)
    step = _Step()
    result = healed.train_step(step, None, 0)  # its first step: the quorum, where it is healed
    assert step.parts == ["zero_grads"], "a site whose training ended computed a step"
    assert result.ended is not None and result.ended.ends_training and result.num_microbatches == 0
    assert "closing exchanges" in result.ended.reason
    m = healed.ctx.membership
    assert m.ended_by is not None and m.ended_by.joined_closing and not m.ended_by.final and m.heals
    assert healed.ended() == result.ended and not healed.finishing
    assert torch.equal(model(healed), model(peer))  # the job's final model
    assert all(torch.equal(a, b) for a, b in zip(healed.outer.anchors, peer.outer.anchors))
    if algorithm == "dilocox":
        assert torch.equal(model(healed), torch.full((4,), -4.0))


def test_a_site_healed_to_the_final_state_during_its_closing_exchanges_stops_exchanging():
    # A site behind the others at its closing exchange (its last mean failed where theirs
    # committed) meets a peer's closing quorum: it receives the job's final state, exchanges
    # nothing more (close_exchanges returns at once) and its training is over (ended_by).
    def make(m):
        return _dilocox(membership=m, numel=4, outer_lr=1.0, outer_momentum=0.0)

    peer = make(scripted_membership())
    _steps(peer, [1.0] * 4)
    peer.finish_training(4)
    served = {"sync": _roundtrip(peer.state_dict()), "model": peer.ctx.optimizer.shards[0].clone()}
    m = scripted_membership(fail={2})  # its mean of round 2 (the closing exchange) does not commit
    site = make(m)
    _steps(site, [1.0] * 4)
    quorum = m.manager.start_quorum

    def healing_quorum(timeout=None):  # the retry's quorum: the peer's closing quorum
        quorum(timeout)
        if m.manager.decisions == 3:
            m._load_heal_counts({"rounds_attempted": 3, "rounds_committed": 3, "finished": True})
            site.load_state_dict(served["sync"])
            site.ctx.optimizer.shards[0].copy_(served["model"])
    m.manager.start_quorum = healing_quorum
    site.finish_training(4)
    assert m.ended_by is not None and m.ended_by.final and m.manager.decisions == 3  # nothing issued after it
    assert site.ended() is not None and site.ended().ends_training and not site.finishing
    assert torch.equal(site.ctx.optimizer.shards[0], peer.ctx.optimizer.shards[0])
    assert torch.equal(site.outer.anchors[0], peer.outer.anchors[0])


def test_a_site_healed_to_the_final_state_ends_through_the_protocol():
    # A diloco site (no exchanges of its own: round_started directly) that a quorum heals to a
    # peer's final state ends training through its step, without computing it.
    from megatron_lsgd.core.lsgd.algorithms.diloco import DiLoCo

    m = scripted_membership()
    ctx = make_context(lsgd_config("diloco", interval=2), [torch.zeros(4)])
    ctx.membership = m
    sync = active(DiLoCo(ctx))
    quorum = m.manager.start_quorum

    def healing_quorum(timeout=None):  # torchft loads a finished peer's state in the quorum
        quorum(timeout)
        m._load_heal_counts({"rounds_attempted": 7, "rounds_committed": 7, "finished": True})
    m.manager.start_quorum = healing_quorum
    step = _Step()
    result = sync.train_step(step, None, 0)
    assert step.parts == ["zero_grads"] and result.ended is not None and result.ended.ends_training
    assert m.ended_by == Heal(committed_round=0, final=True) and m.heals == [m.ended_by]
    assert "the job had finished" in m.lines[-1]


# ---- streaming-diloco and cocodc ----------------------------------------------------------------
def _streaming(cls, compression="none", membership=None, interval=4, sync_delay=1, **kw):
    name = {StreamingDiLoCo: "streaming-diloco", CoCoDC: "cocodc"}[cls]
    block = {"quant_block": 4} if compression in ("int4", "int8", "lowrank-int4") else {}
    cfg = lsgd_config(name, interval=interval, fragments=2, sync_delay=sync_delay, compression=compression, **block,
                      **kw)
    ctx = fragment_context(cfg, width=8)
    if membership is not None:
        ctx.membership = membership
    return active_streaming(cls(ctx))


def _fragment_steps(sync, moves, first=0, before_each=None):
    shard = sync.ctx.optimizer.shard
    for i, move in enumerate(moves):
        if before_each is not None:
            before_each(first + i)
        sync.before_forward_backward(first + i)
        shard -= move
        sync.after_optimizer_step(first + i, True)


STREAMING = [(StreamingDiLoCo, {}), (CoCoDC, {"schedule": "round-robin"}),
             # a sync every step, each in flight for 3: the next quorum comes before a sync lands
             (CoCoDC, {"schedule": "adaptive", "syncs_per_round": 8, "interval": 8, "sync_delay": 3})]
STREAMING_IDS = ["streaming", "cocodc-rr", "cocodc-dense"]
# The fragment fake's pieces are 1-D, which low rank does not factor (dilocox's tests cover it).
FRAGMENT_COMPRESSIONS = [c for c in COMPRESSIONS if c[0] != "lowrank-int4"]


@pytest.mark.parametrize("cls,algo", STREAMING, ids=STREAMING_IDS)
@pytest.mark.parametrize("compression,extra", [("none", {})] + FRAGMENT_COMPRESSIONS, ids=lambda v: str(v))
def test_streaming_elastic_syncs_without_failures_equal_the_plain_run(cls, algo, compression, extra):
    g = torch.Generator().manual_seed(3)
    moves = [torch.randn(48, generator=g) * 0.1 for _ in range(19)]
    plain, elastic = _streaming(cls, compression, **algo, **extra), \
        _streaming(cls, compression, scripted_membership(), **algo, **extra)
    for sync in (plain, elastic):
        _fragment_steps(sync, moves)
        sync.finish_training(19)
    assert torch.equal(plain.ctx.optimizer.shard, elastic.ctx.optimizer.shard)
    assert_same(elastic.state_dict(), plain.state_dict())
    assert [h[:3] for h in plain.history] == [h[:3] for h in elastic.history]


@pytest.mark.parametrize("cls,algo", STREAMING, ids=STREAMING_IDS)
@pytest.mark.parametrize("compression,extra", FRAGMENT_COMPRESSIONS, ids=lambda v: str(v))
def test_a_fragment_sync_that_does_not_commit_is_rolled_back_and_retried(cls, algo, compression, extra):
    g = torch.Generator().manual_seed(4)
    moves = [torch.randn(48, generator=g) * 0.1 for _ in range(22)]
    m = scripted_membership(fail={2})  # decision 0: the first quorum; 2: the second fragment sync
    sync = _streaming(cls, compression, m, **algo, **extra)
    seen, issue = {}, sync.start_sync

    def start_sync(p, t):  # right before the second sync is issued (after its quorum)
        seen["issued"] = seen.get("issued", 0) + 1
        if seen["issued"] == 2:
            views = sync.views[p]
            seen.update(fragment=p, compressor=_roundtrip(sync.fragment_compressors[p].state_dict()),
                        anchor=[a.clone() for a in sync.outer.anchor(views)],
                        momentum=[b.clone() for b in views.select(sync.outer.momenta)])
        return issue(p, t)

    roll_back = sync._roll_back

    def rolled_back(rec):  # (in the dense schedule at the next quorum, before that step trains)
        roll_back(rec)
        v = sync.views[rec.fragment]
        seen["restarted"] = all(torch.equal(mm, a) for mm, a in zip(v.main, sync.outer.anchor(v)))

    sync.start_sync, sync._roll_back = start_sync, rolled_back
    i = 0
    while m.manager.decisions < 3:  # up to the step where the failed sync is decided (and rolled back)
        _fragment_steps(sync, moves[i:i + 1], first=i)
        i += 1
    sync.start_sync = issue
    p = seen["fragment"]
    views = sync.views[p]
    assert m.rounds_committed == 2 and not any(r.fragment == p for r in sync.in_flight)
    # the fragment's anchor and outer momentum did not move, its error feedback is as at the issue
    assert all(torch.equal(a, b) for a, b in zip(sync.outer.anchor(views), seen["anchor"]))
    assert seen["momentum"] and all(torch.equal(a, b) for a, b in zip(views.select(sync.outer.momenta),
                                                                      seen["momentum"]))
    assert_same(sync.fragment_compressors[p].state_dict(), seen["compressor"])
    assert seen["restarted"]  # its local copy restarted from the anchor
    assert sync.retries == 1 and sync.last_start[p] == 0
    resumed = _streaming(cls, compression, scripted_membership(), **algo, **extra)
    resumed.load_state_dict(_roundtrip(sync.state_dict()))
    resumed.ctx.optimizer.shard.copy_(sync.ctx.optimizer.shard)
    landed = len(sync.history)
    _fragment_steps(sync, moves[i:], first=i)
    _fragment_steps(resumed, moves[i:], first=i)
    again = [h[0] for h in sync.history][landed:]
    assert p in again[:2]  # synced again soon (fixed slots: at the very next)
    if algo.get("schedule") != "adaptive":
        assert again[0] == p
    for s in (sync, resumed):
        s.finish_training(len(moves))
    assert torch.equal(sync.ctx.optimizer.shard, resumed.ctx.optimizer.shard)
    assert_same(sync.state_dict(), resumed.state_dict())


def test_the_membership_opens_one_reduction_per_quorum_and_a_final_state_stops_the_site():
    m = scripted_membership()
    ticket = m.start(lambda: SimpleNamespace(done=True, result=[1], poll=lambda: True, wait=lambda: [1]))
    with pytest.raises(RuntimeError, match="finish it before the next quorum"):
        m.round_started()
    with pytest.raises(RuntimeError, match="finish the open one first"):
        m.start(lambda: None)
    assert m.finish(ticket) == [1] and m.finish(ticket) == [1] and m.manager.decisions == 1  # decided once
    assert m.round_started() is None and m.ended_by is None
    m._received = {"rounds_attempted": 0, "rounds_committed": 0, "finished": True}  # a heal at a peer's closing quorum
    heal = m.round_started()
    assert heal == Heal(committed_round=1, final=True) and m.ended_by is heal and heal.ends_training
    assert "the job had finished" in m.lines[-1]


def test_a_site_below_its_floor_past_max_wait_stops_with_one_error_line():
    # Nobody comes (the others stopped, or finished the job before this site came): after
    # --lsgd-ft-max-wait the site raises what the training loop prints as its one error
    # line with exit code 2 (InterSiteTimeout), naming the missing sites, not a traceback.
    m = scripted_membership()
    m.options = SimpleNamespace(min_sites=2, max_wait_s=0.05, timeout_s=1.0, max_failed_rounds=0, lone_site="stop")
    m.comm = SimpleNamespace(set_sites=lambda group, n, sites=None: None, configured_sites=3, clock=Clock())
    m.site, m.poll_s = 2, 0.01
    with pytest.raises(InterSiteTimeout, match=r"site 2: fewer than --lsgd-min-sites 2 sites for --lsgd-ft-max-wait "
                                               r"0.05 s \(missing: 0,1; "):
        m.round_started()
    assert "site 2 waits for --lsgd-min-sites 2 sites (0 s, 1 site(s) in the quorum: 2); missing: 0,1; stops at " \
           "--lsgd-ft-max-wait 0.05 s" in m.lines


def test_a_digest_per_committed_round_none_for_a_state_loaded_from_a_checkpoint(tmp_path):
    def records(path):
        return [(r["round"], r.get("final", False)) for r in map(json.loads, open(path))]

    m, anchor, path = scripted_membership(), torch.zeros(3), str(tmp_path / "d" / "site0_rank0.jsonl")
    m.record_digests(path, lambda: [anchor])
    m.round_started()  # the initial state, committed round 0
    m.finish(m.start(lambda: Finished([])))
    anchor += 1
    m.round_started()
    m.round_started()  # nothing committed since: no second record of round 1
    m.job_finished()
    assert records(path) == [(0, False), (1, False), (1, True)]
    restarted, path = scripted_membership(), str(tmp_path / "d" / "site1_rank0.jsonl")
    restarted.record_digests(path, lambda: [anchor])
    restarted.load_state_dict({"torchft": {"step": 5, "batches_committed": 5}})  # counts itself at 4
    restarted.round_started()  # it holds round 5's checkpoint, not round 4's state: no record
    restarted.finish(restarted.start(lambda: Finished([])))
    restarted.round_started()
    assert records(path) == [(5, False)]


# ---- sync: a round per step ----------------------------------------------------------------------
def _sync(compression="none", membership=None):
    from megatron_lsgd.core.lsgd.algorithms.sync import SyncEveryStep

    block = {"quant_block": 16} if compression in ("int4", "int8") else {}
    cfg = lsgd_config("sync", compression=compression, outer_lr=1.0, outer_momentum=0.0, **block)  # no outer step
    ctx = make_context(cfg, [torch.zeros(48)])
    if membership is not None:
        ctx.membership = membership
    sync = SyncEveryStep(ctx)
    sync.active = True  # the cross-site path on a one-site fake (the mean of one site, still compressed)
    return sync


class _GradStep:
    """An inner step on the fake: the step's gradient is the next of `grads`; apply is SGD at
    lr 0.1 on the shard. `parts` records the order of the step's parts and of its quorum."""

    num_microbatches = 1

    def __init__(self, sync, grads):
        self.sync, self.grads, self.parts = sync, iter(grads), []

    def zero_grads(self):
        self.parts.append("zero_grads")
        self.sync.ctx.optimizer.views().grad[0].zero_()

    def compute_grads(self, data):
        self.parts.append("compute_grads")
        self.sync.ctx.optimizer.views().grad[0].copy_(next(self.grads))
        return []

    def reduce_in_site(self):
        pass

    def apply(self):
        self.parts.append("apply")
        self.sync.ctx.optimizer.shards[0].sub_(0.1 * self.sync.ctx.optimizer.views().grad[0])
        return True, None


def _grads(n, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(48, generator=g) for _ in range(n)]


def _train(sync, grads):
    step = _GradStep(sync, grads)
    return [sync.train_step(step, None, i).update_successful for i in range(len(grads))], step


@pytest.mark.parametrize("compression", ["none", "int8", "topk-2bit"])
def test_sync_elastic_steps_without_failures_equal_the_plain_run(compression):
    grads = _grads(5)
    plain, elastic = _sync(compression), _sync(compression, scripted_membership())
    assert _train(plain, grads)[0] == _train(elastic, grads)[0] == [True] * 5
    assert torch.equal(plain.ctx.optimizer.shards[0], elastic.ctx.optimizer.shards[0])
    assert_same(elastic.state_dict(), plain.state_dict())
    m = elastic.ctx.membership
    assert m.manager.quorums == m.manager.decisions == m.rounds_committed == 5  # a quorum and a round per step


@pytest.mark.parametrize("compression", ["none", "int8", "topk-2bit"])
def test_a_sync_step_whose_mean_does_not_commit_is_not_applied_and_training_goes_on(compression):
    # Decision 2 (the third step's mean) does not commit: that step's inner update is skipped
    # (on every site of the quorum, whose should_commit says the same) and its error feedback
    # put back, so the run equals a plain run that never took that step; the others go on.
    grads = _grads(6)
    m = scripted_membership(fail={2})
    elastic = _sync(compression, m)
    applied, step = _train(elastic, grads)
    assert applied == [True, True, False, True, True, True]
    assert step.parts.count("apply") == 5 and step.parts.count("compute_grads") == 6
    assert m.rounds_committed == 5 and m.rounds_attempted == 6 and "round 3 was not committed" in m.lines[0]
    plain = _sync(compression)
    _train(plain, grads[:2] + grads[3:])
    assert torch.equal(elastic.ctx.optimizer.shards[0], plain.ctx.optimizer.shards[0])
    assert_same(elastic.state_dict(), plain.state_dict())


def test_a_site_joining_a_sync_run_is_healed_before_it_computes_its_first_step():
    # torchft heals a site behind the quorum inside the quorum, which a sync step takes before
    # its forward pass: the fresh site computes its first step from the peer's model and
    # synchronizer state (error feedback), and from then on holds what the peer holds.
    grads = _grads(5)
    peer = _sync("int8", scripted_membership())
    _train(peer, grads[:3])
    served = {"sync": _roundtrip(peer.state_dict()), "model": peer.ctx.optimizer.shards[0].clone()}
    _train(peer, grads[3:])
    site = _sync("int8", scripted_membership())
    m, step = site.ctx.membership, _GradStep(site, grads[3:])
    quorum = m.manager.start_quorum

    def healing_quorum(timeout=None):  # what torchft's heal loads, in the site's first quorum
        step.parts.append("quorum")
        if not m.heals:
            m._load_heal_counts({"rounds_attempted": 3, "rounds_committed": 3, "finished": False})
            site.load_state_dict(served["sync"])
            site.ctx.optimizer.shards[0].copy_(served["model"])
            m.manager.step = 3
        return quorum(timeout)

    m.manager.start_quorum = healing_quorum
    for i in range(3, 5):
        site.train_step(step, None, i)
    assert step.parts[:3] == ["zero_grads", "quorum", "compute_grads"]
    assert len(m.heals) == 1 and m.heals[0].committed_round == 3 and "site 0 rejoined" in m.lines[0]
    assert torch.equal(site.ctx.optimizer.shards[0], peer.ctx.optimizer.shards[0])
    assert_same(site.state_dict(), peer.state_dict())
    assert m.committed_rounds == peer.ctx.membership.committed_rounds == 5
