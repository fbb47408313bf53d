"""streaming-diloco and cocodc without processes: the fixed schedule (torchft's), the
alpha mix, delay compensation (lambda = 0 is the rebase rule), the adaptive choice and its
H-step guarantee, side values riding in a reduction, the reduction queue's ordering, state
round trip, and bad flags. Multi-process properties are in test_streaming_distributed.py."""

from __future__ import annotations

import io
import math
import random
from types import SimpleNamespace

import pytest
import torch

from megatron_lsgd.core.lsgd import catalog
from megatron_lsgd.core.lsgd.algorithms.cocodc import CoCoDC, choose_fragment, syncs_per_round
from megatron_lsgd.core.lsgd.comm import InterSiteComm
from megatron_lsgd.core.lsgd.compressors import build_compressor
from megatron_lsgd.core.lsgd.config import CompressionOptions
from megatron_lsgd.core.lsgd.algorithms.diloco import DiLoCo
from megatron_lsgd.core.lsgd.means import SideValues
from megatron_lsgd.core.lsgd.outer_state import OuterState
from megatron_lsgd.core.lsgd.protocol import SyncContext
from megatron_lsgd.core.lsgd.reduction import ReductionQueue, run_blocking
from megatron_lsgd.core.lsgd.algorithms.streaming import StreamingDiLoCo
from megatron_lsgd.core.optimizer.shard_views import BucketExtent, PieceView, ShardRange, ShardViews
from megatron_lsgd.training.arguments import build_config, parse_args
from tests.unit_tests.lsgd.fakes import lsgd_config, make_context, one_rank_per_site_groups


# ---- a fake with real fragments: one flat shard, each sync unit a contiguous block ------------------
class FragmentOptimizer:
    sharded = False  # one rank per site: nothing to split (SiteSplit)

    def __init__(self, names, width):
        self.names = list(names)
        self.width = width
        self.shard = torch.zeros(len(self.names) * width)
        self.copies = []

    def main_param_shards(self):
        return [self.shard]

    def views(self, units=None):
        names = [u.name for u in units] if units is not None else self.names
        whole = set(names) == set(self.names)
        if whole:
            spans = [(0, self.shard.numel())]
        else:
            spans = sorted((self.names.index(n) * self.width, (self.names.index(n) + 1) * self.width) for n in names)
        ranges = [ShardRange(0, lo, hi) for lo, hi in spans]
        pieces = [PieceView(f"{n}.w", (self.width,), 0, self.width, i, 0, self.width)
                  for i, n in enumerate(sorted(names, key=self.names.index))] if not whole else \
            [PieceView(f"{n}.w", (self.width,), 0, self.width, 0, i * self.width, (i + 1) * self.width)
             for i, n in enumerate(self.names)]
        return ShardViews("all" if whole else "+".join(sorted(names)), tuple(sorted(names)), ranges, pieces,
                          [self.shard[lo:hi] for lo, hi in spans], [torch.zeros(hi - lo) for lo, hi in spans],
                          [BucketExtent(0, lo, hi) for lo, hi in spans], whole)

    def counted_spans(self, views):
        return [(pc.range_index, pc.lo, pc.hi) for pc in views.pieces]  # one rank: every value counts

    def copy_main_to_model_params(self, views=None):
        self.copies.append(views.key if views is not None else "all")


def fragment_context(config, num_layers=4, width=3):
    names = ["embedding"] + [f"layers.{i}" for i in range(num_layers)] + ["output"]
    model = SimpleNamespace(module=SimpleNamespace(config=SimpleNamespace(
        num_layers=num_layers, untie_embeddings_and_output_weights=True)))
    return SyncContext(pgs=one_rank_per_site_groups(), config=config, models=[model],
                       optimizer=FragmentOptimizer(names, width), comm=InterSiteComm(None, 1),
                       units=[SimpleNamespace(name=n) for n in names])


def active(sync):
    """One site, but run the algorithm (the mean of one site is its own pseudo-gradient)."""
    sync.active = True
    sync.outer = OuterState(sync.ctx.optimizer.main_param_shards(), sync.ctx.config.outer)
    sync.device = sync.outer.device
    return sync


def step(sync, it, move):
    """One inner step: the local shard moves by `move` (a tensor or a number)."""
    sync.before_forward_backward(it)
    sync.ctx.optimizer.shard.sub_(move)
    sync.after_optimizer_step(it, True)


# ---- streaming-diloco -------------------------------------------------------------------------------
def test_streaming_slots_follow_torchft():
    """H = 8, K = 2, τ = 1: slots of 4 steps; fragment j mod K starts at step 4(j+1) - 1, lands a step later."""
    cfg = lsgd_config("streaming-diloco", interval=8, outer_lr=1.0, outer_momentum=0.0, fragments=2, sync_delay=1)
    sync = active(StreamingDiLoCo(fragment_context(cfg)))
    for it in range(16):
        step(sync, it, 1.0)
    assert [h[:3] for h in sync.history] == [(0, 3, 4), (1, 7, 8), (0, 11, 12), (1, 15, 16)]
    # strided, untied: fragment 0 = embedding + layers 0, 2; fragment 1 = layers 1, 3 + output
    assert sync.fragment_units == [["embedding", "layers.0", "layers.2"], ["layers.1", "layers.3", "output"]]


def test_streaming_alpha_mixes_the_local_copy():
    """One site, outer lr 1, momentum 0: the new anchor is the local value at the start; alpha
    weights the local value at the landing (torchft's lerp(global, local, alpha))."""
    for alpha in (0.0, 0.25):
        cfg = lsgd_config("streaming-diloco", interval=4, outer_lr=1.0, outer_momentum=0.0, fragments=2,
                          sync_delay=1, alpha=alpha)
        sync = active(StreamingDiLoCo(fragment_context(cfg)))
        views = sync.views[0]
        for it in range(2):  # fragment 0 starts after step 1 (local value -1) and lands after step 2 (-2)
            step(sync, it, 1.0)
        assert torch.equal(torch.cat(sync.outer.anchor(views)), torch.full((views.numel,), -1.0))
        expected = (1 - alpha) * -1.0 + alpha * -2.0
        assert torch.allclose(torch.cat(views.main), torch.full((views.numel,), expected))
        assert torch.equal(torch.cat(sync.views[1].main), torch.full((9,), -2.0))  # not synced yet


def test_k1_tau0_alpha0_is_diloco_on_a_fake():
    kw = dict(interval=3, outer_lr=0.7, outer_momentum=0.9)
    ref = active(DiLoCo(make_context(lsgd_config("diloco", **kw), [torch.zeros(18)])))
    sync = active(StreamingDiLoCo(fragment_context(
        lsgd_config("streaming-diloco", fragments=1, sync_delay=0, **kw))))
    g = torch.Generator().manual_seed(0)
    for it in range(10):
        move = torch.randn(18, generator=g)
        ref.before_forward_backward(it)
        ref.ctx.optimizer.shards[0].sub_(move)
        ref.after_optimizer_step(it, True)
        step(sync, it, move)
        assert torch.equal(ref.ctx.optimizer.shards[0], sync.ctx.optimizer.shard), it
    ref.finish_training(10)
    sync.finish_training(10)
    assert torch.equal(ref.outer.anchors[0], sync.outer.anchors[0])
    assert torch.equal(ref.ctx.optimizer.shards[0], sync.ctx.optimizer.shard)


def test_only_cocodc_s_measuring_schedule_reads_the_clock_each_step():
    # On a GPU a clock reading waits for the compute stream (core/clock.py): streaming-diloco
    # times no step, cocodc times them only while its adaptive schedule measures.
    from megatron_lsgd.core.clock import Clock
    from tests.unit_tests.streams_double import RecordingStreams

    reads = {}
    for label, algo, cls, kw in (("streaming", "streaming-diloco", StreamingDiLoCo, {}),
                                 ("cocodc-fixed-n", "cocodc", CoCoDC, {"schedule": "adaptive", "syncs_per_round": 2}),
                                 ("cocodc-measuring", "cocodc", CoCoDC, {"schedule": "adaptive"})):
        ctx = fragment_context(lsgd_config(algo, interval=16, fragments=2, sync_delay=2, **kw))
        streams = RecordingStreams()
        ctx.comm.clock = Clock(streams)
        sync = active(cls(ctx))
        streams.log.clear()
        for it in range(5):  # the first fragment sync starts after local step 6 (slot 8, tau 2)
            step(sync, it, 0.01)
        reads[label] = sum(1 for _, what, _ in streams.log if what == "synchronize")
    assert reads == {"streaming": 0, "cocodc-fixed-n": 0, "cocodc-measuring": 10}, reads  # a step's start and end


# ---- cocodc delay compensation ---------------------------------------------------------------------
def _cocodc(dc_lambda, schedule="round-robin", **kw):
    args = dict(interval=8, outer_lr=0.7, outer_momentum=0.9, fragments=2, sync_delay=2, dc_lambda=dc_lambda,
                schedule=schedule)
    args.update(kw)
    return active(CoCoDC(fragment_context(lsgd_config("cocodc", **args))))


def _landings(sync, scale, seed):
    """24 steps of random updates (`scale` x normal); at each fragment's landing yields its
    (fragment, snapshot sent, main params just before the landing step), after that step."""
    g = torch.Generator().manual_seed(seed)
    for it in range(24):
        sync.before_forward_backward(it)
        sync.ctx.optimizer.shard.sub_(scale * torch.randn(18, generator=g))
        due = [r for r in sync.in_flight if r.lands == sync.local_step + 1]
        before = [(r.fragment, [s.clone() for s in r.snapshot], [m.clone() for m in sync.views[r.fragment].main])
                  for r in due]
        sync.after_optimizer_step(it, True)
        yield from before


@pytest.mark.parametrize("dc_lambda", [0.0, 0.5])
def test_delay_compensation_formula_and_lambda0_is_the_rebase_rule(dc_lambda):
    """θ ← θ_g + u − λ/(τH) u⊙u⊙d; with λ = 0 bit for bit θ_g + (θ_now − θ_at_start)."""
    sync = _cocodc(dc_lambda)
    landed = 0
    for p, snap, now in _landings(sync, 1.0, seed=1):
        views = sync.views[p]
        a, local = torch.cat(sync.outer.anchor(views)), torch.cat(views.main)
        u = torch.cat(now) - torch.cat(snap)
        if dc_lambda == 0:
            assert torch.equal(local, a + u)  # rebase onto the new global fragment
        else:
            d = a - torch.cat(snap)
            want = a.double() + u.double() - dc_lambda / (2 * 8) * u.double() ** 2 * d.double()
            torch.testing.assert_close(local.double(), want, rtol=1e-6, atol=1e-6)
            assert not torch.equal(local, a + u)
        landed += 1
    assert landed == 6


def test_mean_square_normalized_compensation_acts_at_adam_scale():
    """--lsgd-cocodc-dc-normalize mean-square: θ ← θ_g + u − (λτ/H) (u⊙u / v̂) ⊙ d with v̂ the
    bias-corrected running mean square of u per fragment (by hand, β = 0.5); with steps of
    1e-4 the printed form moves nothing while this one corrects by λτ/H of d at the first landing."""
    beta, lam = 0.5, 0.5
    sync = _cocodc(lam, dc_normalize="mean-square", dc_beta=beta)
    v = {}
    n = {}
    landed = 0
    for p, snap, now in _landings(sync, 1e-4, seed=2):
        views = sync.views[p]
        a, local = torch.cat(sync.outer.anchor(views)).double(), torch.cat(views.main).double()
        u = (torch.cat(now) - torch.cat(snap)).double()
        d = a - torch.cat(snap).double()
        v[p] = beta * v.get(p, 0) + (1 - beta) * u ** 2
        n[p] = n.get(p, 0) + 1
        v_hat = v[p] / (1 - beta ** n[p])
        want = a + u - lam * 2 / 8 * (u ** 2 / v_hat) * d
        torch.testing.assert_close(local, want, rtol=0, atol=1e-7)
        if n[p] == 1:  # u⊙u / v̂ = 1: the correction is λτ/H = 1/8 of d
            torch.testing.assert_close(a + u - local, d / 8, rtol=1e-4, atol=1e-9)
            assert (d / 8).abs().max() > 1e-5
        landed += 1
    assert landed == 6
    state = sync.state_dict()
    assert sorted(state["dc_landings"].items()) == [("0", 3), ("1", 3)]


# ---- adaptive transmission ----------------------------------------------------------------------------
def test_syncs_per_round_rule():
    assert syncs_per_round(4, 100, 0.4, 1.0, 2.0) == 20  # floor(0.4 * 100 * 1 / 2)
    assert syncs_per_round(4, 100, 0.4, 1.0, 100.0) == 4  # at least K
    assert syncs_per_round(4, 100, 0.4, 1.0, 1e-4) == 100  # at most one per step
    assert syncs_per_round(4, 100, 0.4, 0.0, 1.0) == 4  # not measured yet


def _simulate(interval, k, h, tau, steps, ratio_of, seed):
    """Drive choose_fragment like CoCoDC does; return each fragment's start steps."""
    rng = random.Random(seed)
    ratios, last_start, last_land = [math.inf] * k, [0] * k, [0] * k
    in_flight, starts = {}, {p: [0] for p in range(k)}
    next_start = max(1, interval // k - tau)
    for t in range(1, steps + 1):
        for p in [p for p, lands in in_flight.items() if lands == t]:
            ratios[p] = ratio_of(p, rng) / max(1, last_start[p] - last_land[p])
            last_land[p] = t
            del in_flight[p]
        if t >= next_start:
            next_start = t + h
            p = choose_fragment(t, interval, interval // k, ratios, last_start, dict(in_flight))
            if p is not None:
                assert p not in in_flight
                last_start[p] = t
                in_flight[p] = t + tau
                starts[p].append(t)
    return starts


@pytest.mark.parametrize("interval,k,h,tau", [(100, 4, 25, 5), (100, 4, 5, 5), (100, 4, 2, 5), (100, 4, 1, 5),
                                              (12, 3, 3, 2), (10, 3, 1, 2), (16, 2, 3, 7), (9, 4, 2, 1)])
@pytest.mark.parametrize("kind", ["random", "one-hot-fragment"])
def test_adaptive_choice_syncs_every_fragment_within_h_steps(interval, k, h, tau, kind):
    ratio_of = (lambda p, rng: rng.random()) if kind == "random" else (lambda p, rng: 1e6 if p == 0 else 1e-6)
    starts = _simulate(interval, k, h, tau, 40 * interval, ratio_of, seed=interval * k + h)
    for p, ts in starts.items():
        gaps = [b - a for a, b in zip(ts, ts[1:])]
        assert gaps and max(gaps) <= interval, (p, max(gaps))
    if h < interval // k and kind == "one-hot-fragment":  # spare slots go to the fragment that moves most
        assert len(starts[0]) > max(len(ts) for p, ts in starts.items() if p != 0)


def test_first_syncs_cover_every_fragment_then_follow_the_ratio():
    starts = _simulate(40, 4, 2, 1, 40, lambda p, rng: float(p + 1), seed=0)
    first = sorted((ts[1], p) for p, ts in starts.items())
    assert [p for _, p in first] == [0, 1, 2, 3]


# ---- side values and the reduction queue ---------------------------------------------------------------
@pytest.mark.parametrize("kind,variant,rank", [("none", "auto", 0), ("int4", "allgather", 0),
                                               ("int8", "alltoall", 0), ("lowrank-int4", "allgather", 2),
                                               ("topk-2bit", "auto", 0)])
def test_side_values_ride_along_without_changing_the_mean(kind, variant, rank):
    comm = InterSiteComm(None, 1)
    opts = CompressionOptions(kind=kind, rank=rank, quant_block=8, quantized_mean=variant)
    layout = [[((6, 8), 0, 48, 0, 48), ((10,), 0, 10, 48, 58)]]
    x = torch.randn(58, generator=torch.Generator().manual_seed(3))
    a = build_compressor(opts, comm, [torch.Size([58])], layout, 5, torch.device("cpu"))
    b = build_compressor(opts, comm, [torch.Size([58])], layout, 5, torch.device("cpu"))
    side = SideValues(torch.tensor([0.123, 4.5e-3]))
    plain = run_blocking(a.reduce([x]))
    with_side = run_blocking(b.reduce([x], side))
    assert torch.equal(plain[0], with_side[0])
    assert torch.equal(side.mean, torch.tensor([0.123, 4.5e-3]))


def test_reduction_queue_issues_one_reduction_after_another():
    issued = []

    class Handle:
        def __init__(self, name):
            self.name, self.ready = name, False
            issued.append(name)

        def is_completed(self):
            return self.ready

        def wait(self):
            self.ready = True

    handles = {}

    def reduction(tag):
        for phase in (1, 2):
            handles[tag, phase] = Handle(f"{tag}{phase}")
            yield handles[tag, phase]
        return tag

    q = ReductionQueue()
    a, b = q.submit(reduction("a")), q.submit(reduction("b"))
    assert issued == ["a1"]  # b waits for a
    handles["a", 1].ready = True
    q.poll()
    assert issued == ["a1", "a2"]
    assert q.wait(b) == "b" and a.done and a.result == "a"
    assert issued == ["a1", "a2", "b1", "b2"] and len(q) == 0


# ---- state, stats, flags ------------------------------------------------------------------------------
def _roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_cocodc_state_with_a_sync_in_flight_resumes_exactly():
    kw = dict(compression="int4", quant_block=8, syncs_per_round=4, schedule="adaptive")
    ref, other = _cocodc(0.5, **kw), _cocodc(0.5, **kw)
    g = torch.Generator().manual_seed(2)
    moves = [torch.randn(18, generator=g) for _ in range(20)]
    for it in range(9):
        step(ref, it, moves[it])
        step(other, it, moves[it])
    assert ref.in_flight, "a fragment is in flight at the save"
    state = _roundtrip(ref.state_dict())
    resumed = _cocodc(0.5, **kw)
    resumed.ctx.optimizer.shard.copy_(ref.ctx.optimizer.shard)
    resumed.load_state_dict(state)
    for it in range(9, 20):
        step(other, it, moves[it])
        step(resumed, it, moves[it])
    other.finish_training(20)
    resumed.finish_training(20)
    assert torch.equal(other.ctx.optimizer.shard, resumed.ctx.optimizer.shard)
    assert torch.equal(other.outer.anchors[0], resumed.outer.anchors[0])
    assert [h for h in other.history if h[2] > 9] == list(resumed.history)  # the same syncs after the resume
    assert resumed.stats()["N"] == 4


def _config(extra):
    base = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "1", "--train-iters", "10", "--lr", "1e-3", "--mock-data", "--vocab-size", "100",
            "--num-sites", "2"]
    return build_config(parse_args(base + extra), 2)


@pytest.mark.parametrize("extra,flag", [
    (["--lsgd-algorithm", "streaming-diloco", "--lsgd-fragments", "5", "--lsgd-interval", "10"],
     "--lsgd-fragments 5 is more than the model's 4 layers"),
    (["--lsgd-algorithm", "cocodc", "--lsgd-fragments", "0"], "--lsgd-fragments must be >= 1"),
    (["--lsgd-algorithm", "streaming-diloco", "--lsgd-interval", "10", "--lsgd-fragments", "4"],
     "--lsgd-interval 10 must be a multiple of --lsgd-fragments 4"),
    (["--lsgd-algorithm", "streaming-diloco", "--lsgd-interval", "8", "--lsgd-fragments", "4",
      "--lsgd-fragment-sync-delay", "2"], "--lsgd-fragment-sync-delay 2 must be < "),
    (["--lsgd-algorithm", "cocodc", "--lsgd-interval", "9", "--lsgd-fragments", "4",
      "--lsgd-fragment-sync-delay", "2"], "--lsgd-fragment-sync-delay 2 must be < "),
    (["--lsgd-algorithm", "cocodc", "--lsgd-cocodc-schedule", "round-robin", "--lsgd-interval", "10",
      "--lsgd-fragments", "4"], "--lsgd-interval 10 must be a multiple of --lsgd-fragments 4 with"),
    (["--lsgd-algorithm", "cocodc", "--lsgd-fragment-sync-delay", "-1"], "--lsgd-fragment-sync-delay must be >= 0"),
    (["--lsgd-algorithm", "streaming-diloco", "--lsgd-fragment-update-alpha", "1.5"], "--lsgd-fragment-update-alpha"),
    (["--lsgd-algorithm", "cocodc", "--lsgd-cocodc-gamma", "0"], "--lsgd-cocodc-gamma must be in"),
    (["--lsgd-algorithm", "cocodc", "--lsgd-cocodc-lambda", "-0.1"], "--lsgd-cocodc-lambda must be >= 0"),
    (["--lsgd-algorithm", "cocodc", "--lsgd-cocodc-syncs-per-round", "1"], "--lsgd-cocodc-syncs-per-round 1 must"),
    (["--lsgd-algorithm", "cocodc", "--lsgd-cocodc-schedule", "round-robin", "--lsgd-cocodc-syncs-per-round", "4"],
     "--lsgd-cocodc-syncs-per-round needs --lsgd-cocodc-schedule adaptive"),
    (["--lsgd-algorithm", "streaming-diloco", "--lsgd-cocodc-lambda", "0.1"],
     "--lsgd-cocodc-lambda needs --lsgd-algorithm cocodc"),
    (["--lsgd-algorithm", "diloco", "--lsgd-fragments", "4"],
     "--lsgd-fragments needs --lsgd-algorithm cocodc or streaming-diloco"),
    (["--lsgd-algorithm", "cocodc", "--lsgd-fragment-update-alpha", "0.5"],
     "--lsgd-fragment-update-alpha needs --lsgd-algorithm streaming-diloco"),
])
def test_bad_flags_name_the_flag(extra, flag):
    with pytest.raises(ValueError, match=flag):
        _config(extra)


def test_defaults_build_and_compression_is_accepted():
    for algo in ("streaming-diloco", "cocodc"):
        cfg = _config(["--lsgd-algorithm", algo, "--lsgd-compression", "int4"]).lsgd
        assert cfg.algo.fragments == 2 and cfg.algo.sync_delay == 1 and cfg.rounds.interval == 50
    assert catalog.synchronizer_class("cocodc").Options().dc_lambda == 0.5


def test_a_checkpoint_of_another_fragment_schedule_is_refused_naming_the_flag():
    saved = _roundtrip(_cocodc(0.5).state_dict())
    with pytest.raises(ValueError, match="--lsgd-fragment-sync-delay 2, this run has 1"):
        _cocodc(0.5, sync_delay=1).load_state_dict(saved)
    with pytest.raises(ValueError, match="--lsgd-cocodc-schedule round-robin, this run has adaptive"):
        _cocodc(0.5, schedule="adaptive").load_state_dict(saved)
