"""`streaming-diloco`: DiLoCo whose outer sync is spread over the round, one fragment of the
model at a time, each fragment's all-reduce overlapping τ further inner steps (Douillard et
al., Streaming DiLoCo; DESIGN.md §4.3). The schedule and the meaning of every knob follow
torchft's `DiLoCo` with several fragments, so settings carry over one to one:

    --lsgd-interval H               sync_every
    --lsgd-fragments K              len(model_fragments)
    --lsgd-fragment-sync-delay τ    fragment_sync_delay
    --lsgd-fragment-update-alpha α  fragment_update_alpha (α weights the LOCAL copy)

A round of H inner steps is cut into K slots of S = H/K steps. Slot j (counting from the
end of the warm-up, j = 0, 1, ...) belongs to fragment j mod K:

    local step (j+1)·S − τ   Δ_p = θ_g,p − θ_local,p on this rank's shard; its (compressed)
                             mean over sites starts, on a dedicated dp_inter group
    local step (j+1)·S       wait for the mean; keep θ_local,p aside; θ_g,p ← OuterSGD(θ_g,p, Δ̄_p)
                             (Nesterov, this fragment's own momentum); θ_local,p ←
                             lerp(θ_g,p, θ_local,p, α) = (1 − α)·θ_g,p + α·θ_local,p

So each fragment's anchor spans H steps between its own syncs, about 1/K of the model is on
the wire at any time, and with α = 0 the τ steps of local progress on that fragment are
dropped (α = 1 would keep only the local copy). K = 1, τ = 0, α = 0 is `diloco` exactly.

Fragments (`fragments.py`) are sets of sync units, sequential or strided over the global
layers, with the embedding in layer 0's fragment and the output head in the last layer's
(or, tied, in the embedding's). Everything is done on this rank's ZeRO-1 slices through
the unit <-> shard bridge (`optimizer.views(units)`), with one `OuterState` over the
shards stepped per fragment and one compressor (error feedback) per fragment. A pipeline
stage that holds no unit of a fragment has empty views for it: so do its peers on every
site (the partition is the same everywhere), and the whole dp_inter group skips that
fragment's reduction together.

Sites of different TP x PP (docs/heterogeneous_sites.md): a fragment crosses sites in the
layout-free form as its units on every stage and site (CanonicalExchange, on lanes of its
own): the site assembles it where the sync starts, the lanes' means overlap the τ steps,
and the site reads it back where it lands; every rank of the site takes part, also a stage
that holds none of the fragment's units.

Sites of different data-parallel sizes (docs/heterogeneous_sites.md): a fragment's mean is
weighted by the sites' tokens and runs lane by lane (SiteSplit.lane_mean) on clones of the
lane groups of its own; a rank cuts its part of the fragment at the lanes' places, which
are the same ranges of every bucket on every site. Compressed (int8/int4), each lane of a
fragment has a compressor of its own and each site's contribution is scaled by its weight
(SiteSplit.lane_compressors, lane_reduce; CoCoDC's times then ride exactly beside them).

When --train-iters is reached, `finish_training` lands the fragments still in flight and
then gives every fragment that holds unsynchronized progress one last blocking sync (as
diloco closes a partial round), so every site ends with the same model: the membership's
`close_exchanges`, the same for every membership.

Every sync goes through the membership (membership.py, `Exchanges`), which decides where it
is issued: a sync taken after step t is due (`taken`), and a fixed set of sites issues it
at once. Elastic sites (--lsgd-fault-tolerance torchft, docs/fault_tolerance.md) take a
quorum per fragment sync, as torchft's Streaming DiLoCo does: the sync is issued at the
start of step t+1, right after its quorum (`step_started`; where a returning site is
healed; hence tau >= 1), and decided (committed or not) where it lands, or earlier when the
next quorum comes first (only one reduction is ever open). Not committed: the fragment's
anchor and outer momentum stay, its error feedback is put back, its local copy restarts
from the anchor, and the next slot retries the same fragment (torchft's rule; CoCoDC's
adaptive schedule picks it again by its staleness).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from megatron_lsgd.core.lsgd.canonical_exchange import exchange_for, use_dedicated_lanes
from megatron_lsgd.core.lsgd.compressors import CompressorBank, compression_error
from megatron_lsgd.core.lsgd.fragments import PARTITIONS, partition
from megatron_lsgd.core.lsgd.means import SideValues, fp32_mean
from megatron_lsgd.core.lsgd.membership import Finished
from megatron_lsgd.core.options import OptionGroup, option
from megatron_lsgd.core.lsgd.outer_state import OuterState
from megatron_lsgd.core.lsgd.protocol import SyncContext, Synchronizer
from megatron_lsgd.core.lsgd.reduction import QueuedReduce, Reduction, ReductionQueue
from megatron_lsgd.core.lsgd.registry import register
from megatron_lsgd.core.lsgd.site_split import SiteSplit
from megatron_lsgd.core.lsgd.warmup import SynchronousWarmup


# ---- options ------------------------------------------------------------------------------------
@dataclass
class FragmentOptions(OptionGroup):
    """How the model is split into fragments that sync one at a time."""

    title = "streaming fragments"

    fragments: int = option("--lsgd-fragments", 2,
                            "K: split the model into K fragments of sync units that sync one at a time "
                            "(torchft: the number of model_fragments)", metavar="K")
    partition: str = option("--lsgd-fragment-partition", "strided",
                            "which layers form a fragment: strided (layer i in fragment i mod K) or sequential "
                            "(K contiguous blocks); the embedding goes with layer 0, the output head with the "
                            "last layer (with the embedding when tied)", choices=PARTITIONS)
    sync_delay: int = option("--lsgd-fragment-sync-delay", 1,
                             "tau: inner steps a fragment's all-reduce overlaps before its outer step is applied "
                             "(torchft: fragment_sync_delay)", metavar="TAU")

    def validate(self, config, num_sites: int, run=None, **_) -> None:
        interval, k, tau = config.rounds.interval, self.fragments, self.sync_delay
        num_layers = run.num_layers if run is not None else None
        if k < 1:
            raise ValueError(f"--lsgd-fragments must be >= 1 (got {k})")
        if num_layers is not None and k > num_layers:
            raise ValueError(f"--lsgd-fragments {k} is more than the model's {num_layers} layers (--num-layers): "
                             f"every fragment needs at least one layer")
        if self.partition not in PARTITIONS:
            raise ValueError(f"--lsgd-fragment-partition {self.partition!r}: choose one of {', '.join(PARTITIONS)}")
        if k > interval:
            raise ValueError(f"--lsgd-fragments {k} is more than --lsgd-interval {interval}: each of the K "
                             f"fragments needs its own step of the round")
        if tau < 0:
            raise ValueError(f"--lsgd-fragment-sync-delay must be >= 0 (got {tau})")
        slot = interval // k
        if tau >= slot:
            raise ValueError(f"--lsgd-fragment-sync-delay {tau} must be < --lsgd-interval / --lsgd-fragments = "
                             f"{interval} // {k} = {slot}: a fragment's all-reduce must land within its slot of "
                             f"H/K steps")


@dataclass
class StreamingDiLoCoOptions(FragmentOptions):
    alpha: float = option("--lsgd-fragment-update-alpha", 0.0,
                          "alpha: after a fragment's outer step, keep (1 - alpha) x the new global fragment + "
                          "alpha x the local one (torchft: fragment_update_alpha; 0 drops the tau steps of local "
                          "progress)", metavar="ALPHA")

    def validate(self, config, num_sites: int, run=None, **_) -> None:
        super().validate(config=config, num_sites=num_sites, run=run)
        interval, k = config.rounds.interval, self.fragments
        if interval % k:
            raise ValueError(f"--lsgd-interval {interval} must be a multiple of --lsgd-fragments {k}: the round "
                             f"is cut into K slots of H/K steps (as torchft requires)")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"--lsgd-fragment-update-alpha must be in [0, 1] (got {self.alpha})")


@dataclass
class InFlight:
    """One fragment's sync between its start and its landing."""

    fragment: int
    started: int  # local step (after warm-up) at which Δ was taken
    lands: int  # local step at which its outer step is applied
    ticket: QueuedReduce
    round: object  # the membership's ticket (decides whether the sync commits)
    snapshot: List[torch.Tensor] = field(default_factory=list)  # cocodc: θ_local at the start
    side: Optional[SideValues] = None  # cocodc: measured times riding along
    prev_start: int = 0  # the fragment's last start before this one (restored if it does not commit)


class _Queued:
    """A reduction of the queue, as the work of a membership ticket."""

    def __init__(self, queue: ReductionQueue, gen: Reduction):
        self.queue = queue
        try:
            self.item = queue.submit(gen)
        except Exception:
            queue.clear()  # its first collective failed: nothing else is in flight
            raise

    @property
    def done(self) -> bool:
        return self.item.done

    @property
    def result(self):
        return self.item.result

    def poll(self) -> bool:
        self.queue.poll()
        return self.item.done

    def wait(self):
        return self.queue.wait(self.item)

    def abandon(self) -> None:
        self.queue.clear()


# ---- the algorithm ------------------------------------------------------------------------------
@register
class StreamingDiLoCo(SynchronousWarmup, Synchronizer):
    """Streaming DiLoCo: one fragment synced per H/K inner steps, its all-reduce overlapping tau steps"""

    name = "streaming-diloco"
    unequal_sites_refusal = None  # fragment means weighted by tokens, lane by lane on lanes of its own (SiteSplit)
    unequal_sites_compressions = ("int8", "int4")  # a compressor per lane of each fragment, contributions scaled
    elastic_unequal_sites_refusal = None  # a heal re-cuts the means in flight (per_part_state)
    mixed_layouts_refusal = None  # fragments cross sites in the layout-free form, on lanes of their own
    Options = StreamingDiLoCoOptions
    uses = frozenset({"rounds", "outer", "compression"})
    state_follows_pipeline = True  # a fragment is the stage's units of it (its key names them)
    fault_tolerance_refusal = None  # its rounds run through SiteMembership's quorums

    @classmethod
    def refused_with_fault_tolerance(cls, config) -> List:
        if config.algo.sync_delay == 0:
            return [("--lsgd-fragment-sync-delay 0", "a fragment's sync is issued after its quorum, at the start of "
                                                     "the next step; give it at least 1")]
        return []

    def __init__(self, ctx: SyncContext):
        super().__init__(ctx)
        cfg, algo = ctx.config, ctx.config.algo
        self.interval = cfg.rounds.interval
        self.num_fragments = algo.fragments
        self.tau = algo.sync_delay
        num_layers, tied = ctx.model_layers()
        groups = partition(ctx.units, num_layers, self.num_fragments, algo.partition, tied)
        opt = ctx.optimizer
        self.fragment_units = [[u.name for u in g] for g in groups]
        # sites of different sizes: fragments are cut at the lanes' places (SiteSplit's shard sizes)
        self.split = SiteSplit(ctx.pgs, opt.sharded, [m.numel() for m in opt.main_param_shards()])
        self.full_views = [opt.views(g) for g in groups]
        self.views = [self.split.mine(v) for v in self.full_views]  # what this rank sends across sites
        self.outer = OuterState(opt.main_param_shards(), cfg.outer) if self.active else None
        self.device = self.outer.device if self.outer else opt.main_param_shards()[0].device
        self.compressors = CompressorBank(cfg.compression, ctx.comm, cfg.seed)
        # sites of different sizes, compressed: a compressor per lane of each fragment, weighted
        # (SiteSplit.lane_compressors), in place of the fragment's own
        self.lane_compressors = [self.split.lane_compressors(self.compressors, v, self.device, ctx.comm)
                                 if self.active and cfg.compression.enabled and not v.empty else []
                                 for v in self.views]
        self.fragment_compressors = [None if v.empty or lanes else self.compressors.for_views(v, self.device)
                                     for v, lanes in zip(self.views, self.lane_compressors)]
        # sites of different TP x PP: fragments cross sites in the layout-free form, as the sets
        # of units they are on every stage and site (None otherwise)
        self.exchange = exchange_for(ctx) if self.active else None
        self.exchange_units = None if self.exchange is None else [
            [u.name for u in g] for g in partition(self.exchange.units, num_layers, self.num_fragments,
                                                   algo.partition, tied)]
        if self.active:  # reductions advance between steps: keep them off the shared dp_inter groups
            use_dedicated_lanes(ctx, self.exchange, self.split)
        self.queue = ReductionQueue(ctx.comm)
        self.local_step = 0  # inner steps since the warm-up ended
        self.in_flight: List[InFlight] = []  # in start order
        self.last_start = [0] * self.num_fragments  # local step of each fragment's last start (0: the anchor)
        self.last_land = [0] * self.num_fragments
        self.dirty = [False] * self.num_fragments  # local copy may differ from the anchor
        self.syncs = 0  # landed fragment syncs
        # Fragments whose sync was taken and not yet issued (elastic sites: until the next
        # step's quorum; otherwise issued at once), failed syncs so far (each shifts the fixed
        # slots: the failed fragment goes again), and whether the closing syncs are under way.
        self.due: List[int] = []
        self.retries = 0
        self.finishing = False
        # (fragment, start, land, bytes this rank sent) of this process's recent syncs, for tests and tools
        self.history: deque = deque(maxlen=10000)
        self._step_started: Optional[float] = None

    # ---- schedule (subclasses change it) ----------------------------------------------------------
    def starts_at(self, t: int) -> List[int]:
        """Fragments whose sync starts after local step t: torchft's fixed slots."""
        slot = self.interval // self.num_fragments
        if (t + self.tau) % slot:
            return []
        return [((t + self.tau) // slot - 1 - self.retries) % self.num_fragments]

    # ---- hooks ----------------------------------------------------------------------------------------
    def before_forward_backward(self, iteration: int) -> None:
        # timed only for an algorithm that uses it (cocodc's schedule): on a GPU a reading drains the stream
        self._step_started = self.ctx.clock.now() if self.times_steps() else None
        if self.active:  # elastic sites: a quorum for each sync due, each issued right after it
            self.ctx.membership.step_started(self)
        if self.active and len(self.queue):
            self._poll()

    def _poll(self) -> None:
        """Advance the reductions in flight without blocking: the oldest unfinished one's
        ticket polls the whole queue (an elastic membership's reports a failure, never raises)."""
        for rec in self.in_flight:
            if not rec.round.done:
                rec.round.poll()
                return

    # ---- Exchanges: what the membership's rhythm drives (membership.py) ---------------------------
    def exchange_due(self) -> bool:
        return bool(self.due)

    def issue_due(self) -> None:
        self.start_sync(self.due.pop(0), self.local_step)

    def decide_open(self) -> None:
        for rec in list(self.in_flight):
            self._decide(rec)

    def land_in_flight(self) -> None:
        for rec in list(self.in_flight):
            self.land(rec, self.local_step)

    def closing_due(self) -> bool:
        return bool(self.due) or any(self.dirty)

    def close_one(self) -> None:
        """A sync due (taken, not yet issued) lands at once; else one last sync of the first
        fragment with local progress."""
        if self.due:
            self.land(self.start_sync(self.due.pop(0), self.local_step), self.local_step)
        else:
            self._final_sync(self.dirty.index(True))

    def closed(self) -> None:
        pass

    def _decide(self, rec: InFlight) -> Optional[List[torch.Tensor]]:
        """The sync's mean if its round commits; else the fragment is rolled back (None)."""
        mean = self.ctx.membership.finish(rec.round)
        if mean is None and any(r is rec for r in self.in_flight):
            self._roll_back(rec)
        return mean

    def _roll_back(self, rec: InFlight) -> None:
        """A sync that did not commit: the anchor stays, the local copy restarts from it, and
        the fragment is due again (its error feedback was put back by the membership)."""
        p = rec.fragment
        if not self.views[p].empty:
            self.outer.load_into(self.views[p])
        self.publish(p)  # a site collective even when this rank's views are empty
        self.dirty[p] = False
        self.in_flight.remove(rec)
        self.last_start[p] = rec.prev_start
        self.retries += 1

    def after_optimizer_step(self, iteration: int, update_successful: bool) -> None:
        if not self.active:
            return
        if self.warming_up(iteration, self.outer, self.ctx.optimizer.views()):
            return
        if self._step_started is not None:
            self.record_step_time(self.ctx.clock.now() - self._step_started)
            self._step_started = None
        # Skipped (fp16 overflow) steps count too: sites must agree on the schedule.
        self.local_step += 1
        t = self.local_step
        self.dirty = [True] * self.num_fragments
        self._poll()
        self._land_due(t)
        self.due.extend(self.starts_at(t))
        self.ctx.membership.taken(self)  # issued now, or (elastic sites) after the next step's quorum
        self._land_due(t)  # τ = 0: the fragment lands in the step it started

    def times_steps(self) -> bool:
        """Whether record_step_time wants each inner step's time (CoCoDC's adaptive schedule)."""
        return False

    def record_step_time(self, seconds: float) -> None:
        """CoCoDC measures its step time here."""

    # ---- one fragment's sync ----------------------------------------------------------------------------
    def side_values(self) -> Optional[SideValues]:
        """Small values to carry in the next sync's payload (CoCoDC's measured times)."""
        return None

    def _reduction(self, p: int, deltas: List[torch.Tensor], side: Optional[SideValues]) -> Optional[Reduction]:
        if self.exchange is not None:  # every rank of the site takes part (its scatter runs now, here)
            return self.exchange.issue(self.ctx.comm, self.views[p], deltas, self.exchange_units[p], side)
        if self.split.lanes:  # sites of different sizes: weighted, lane by lane
            if self.views[p].empty and side is None:
                return None  # so are this rank's lanes on their other ends
            if self.ctx.config.compression.enabled:
                return self.split.lane_reduce(self.ctx.comm, self.views[p], deltas,
                                              [c.reduce for c in self.lane_compressors[p]], side, self.device)
            return self.split.lane_mean(self.ctx.comm, self.views[p], deltas, self.device, side)
        if not self.views[p].empty:
            return self.fragment_compressors[p].reduce(deltas, side)
        if side is None:
            return None  # every peer of this dp_inter group skips it too

        def side_only():
            yield from fp32_mean(self.ctx.comm, torch.zeros(0, device=self.device), side)
            return []
        return side_only()

    def start_sync(self, p: int, t: int) -> InFlight:
        views = self.views[p]
        deltas = self.outer.pseudo_gradient(views)
        side = self.side_values()
        snapshot = self.snapshot(p)
        round_, ticket = self._start_round(p, self._reduction(p, deltas, side))
        rec = InFlight(p, t, t + self.tau, ticket, round_, snapshot, side, self.last_start[p])
        self.in_flight.append(rec)
        self.last_start[p] = t
        return rec

    def _start_round(self, p: int, gen: Optional[Reduction]) -> Tuple[object, QueuedReduce]:
        """The sync as the round's reduction, through the membership (its error feedback is
        undone if it does not commit): its ticket and the queue's item (a finished empty one
        when nothing was queued). Every rank of the site takes the round, even one with
        nothing to send."""
        undo = [c for c in [self.fragment_compressors[p], *self.lane_compressors[p]] if c is not None]
        issued: List[_Queued] = []

        def issue():
            if gen is None:
                return Finished([])
            issued.append(_Queued(self.queue, gen))
            return issued[0]
        round_ = self.ctx.membership.start(issue, undo=undo)
        return round_, issued[0].item if issued else QueuedReduce.finished([])

    snapshots = False  # snapshot() keeps something (per_part_state)

    def snapshot(self, p: int) -> List[torch.Tensor]:
        """What the landing rule needs from the start (CoCoDC: θ_local)."""
        return []

    def _land_due(self, t: int) -> None:
        for rec in [r for r in self.in_flight if r.lands <= t]:
            self.land(rec, t)

    def land(self, rec: InFlight, t: int) -> None:
        """Wait for the fragment's mean, take its outer step, merge, push it into the model
        (only if its round commits, else the fragment is rolled back)."""
        mean = self._landed(rec.fragment, self._decide(rec))
        if mean is None:
            return
        self.dirty[rec.fragment] = self.merge(rec, mean, t)
        self.publish(rec.fragment)  # a site collective even when this rank's views are empty
        self.in_flight.remove(rec)
        self.history.append((rec.fragment, rec.started, t, rec.ticket.bytes_sent))
        self.after_landing(rec, mean, t)
        self.last_land[rec.fragment] = t
        self.syncs += 1
        self.ctx.comm.rounds += 1

    def _landed(self, p: int, mean: Optional[List[torch.Tensor]]) -> Optional[List[torch.Tensor]]:
        """A committed mean of fragment p as its views' ranges: sites of different layouts read
        it back from this rank's lanes here, where every rank of the site lands it."""
        if mean is None or self.exchange is None:
            return mean
        return self.exchange.land(self.views[p], mean, self.exchange_units[p])

    @torch.no_grad()
    def merge(self, rec: InFlight, mean: List[torch.Tensor], t: int) -> bool:
        """θ_g ← OuterSGD(θ_g, Δ̄); θ_local ← lerp(θ_g, θ_local, α). Returns whether the local
        copy may now differ from the anchor."""
        views, alpha = self.views[rec.fragment], self.ctx.config.algo.alpha
        if views.empty:
            return alpha > 0
        if alpha == 0:
            self.outer.step(views, mean)
            self.outer.load_into(views)
            return False
        kept = [m.to(self.device, copy=True) for m in views.main]
        self.outer.step(views, mean)
        for m, a, local in zip(views.main, self.outer.anchor(views), kept):
            m.copy_(torch.lerp(a, local, alpha))
        return True

    def publish(self, p: int) -> None:
        """Fragment p's main parameters changed on this rank's part: the site gathers the parts
        (when split, SiteSplit) and the model takes the fragment."""
        full = self.full_views[p]
        self.split.gather_views(full)
        self.ctx.optimizer.copy_main_to_model_params(full)

    def after_landing(self, rec: InFlight, mean: List[torch.Tensor], t: int) -> None:
        """CoCoDC updates its schedule here."""

    # ---- end of training, quiesce, state ----------------------------------------------------------------
    def quiesce(self) -> None:
        """Let every reduction in flight finish (each is applied at its usual step) and decide
        it (elastic sites: committed or not), so a checkpoint holds committed syncs only. A
        reduction finished here was waited for, not observed, so it carries no time."""
        if len(self.queue):
            unfinished = [r.ticket for r in self.in_flight if not r.ticket.done]
            for rec in self.in_flight:  # in start order: the queue's
                rec.round.wait()
            for ticket in unfinished:
                ticket.finished_at = None
        self.decide_open()

    def finish_training(self, iteration: int) -> None:
        """Land what is in flight, issue and land the syncs due, then one last sync of every
        fragment with local progress, each a round of its own (membership.close_exchanges: a
        site healed at one of these quorums holds the peer's state, what is due and which
        fragments are dirty, and joins in from there)."""
        if self.active:
            self.ctx.membership.close_exchanges(self)

    def _final_sync(self, p: int) -> None:
        """Blocking sync of one fragment, after which every site holds its anchor (its anchor
        as it was, when the round does not commit)."""
        views = self.views[p]
        gen = self._reduction(p, self.outer.pseudo_gradient(views), None)
        round_, ticket = self._start_round(p, gen)
        mean = self._landed(p, self.ctx.membership.finish(round_))
        sent = ticket.bytes_sent
        if mean is not None and gen is not None:
            self.outer.step(views, mean)
            self.syncs += 1
        if not views.empty:
            self.outer.load_into(views)
        self.publish(p)
        self.history.append((p, self.local_step, self.local_step, sent))
        self.dirty[p] = False
        self.ctx.comm.rounds += 1

    # what a checkpoint's schedule depends on: setting -> its flag
    setting_flags = {"interval": "--lsgd-interval", "fragments": "--lsgd-fragments",
                     "partition": "--lsgd-fragment-partition", "sync_delay": "--lsgd-fragment-sync-delay"}

    def _settings(self) -> Dict:
        algo = self.ctx.config.algo
        return {"interval": self.interval, "fragments": self.num_fragments, "partition": algo.partition,
                "sync_delay": self.tau}

    def per_part_state(self, state: Dict) -> List[Tuple[List[torch.Tensor], object]]:
        # the means in flight (and cocodc's snapshots) are on the rank's part of their fragment
        keys = ("mean", "snapshot") if self.snapshots else ("mean",)
        return [(f[key], self.full_views[int(f["fragment"])]) for f in state["in_flight"] for key in keys]

    def per_parameter_state(self) -> Dict[str, List[object]]:
        # The anchor and outer momentum are this rank's on the fragments' parts it sends.
        return {"outer/anchors": list(self.views), "outer/momentum": list(self.views)} if self.outer else {}

    def state_dict(self) -> Dict:
        # quiesce() finished the reductions in flight, and with them their error-feedback updates.
        self.require_quiesced(len(self.queue) > 0)
        flights = []
        for rec in self.in_flight:
            flights.append({"fragment": rec.fragment, "started": rec.started, "lands": rec.lands,
                            "mean": [m.clone() for m in rec.ticket.result],
                            "snapshot": [s.clone() for s in rec.snapshot],
                            "has_side": int(rec.side is not None),
                            "side_mean": rec.side.mean.clone() if rec.side is not None else torch.empty(0)})
        state = {"settings": self._settings(), "local_step": self.local_step, "last_start": list(self.last_start),
                 "last_land": list(self.last_land), "dirty": [int(d) for d in self.dirty], "syncs": self.syncs,
                 "in_flight": flights, "outer": self.outer.state_dict() if self.outer else {},
                 "compressors": self.compressors.state_dict()}
        # elastic sites only (a plain run's state has none of them)
        if self.due:
            state["due"] = list(self.due)
        if self.retries:
            state["retries"] = self.retries
        if self.finishing:
            state["finishing"] = 1
        return state

    def load_state_dict(self, state: Dict) -> None:
        saved, now = state["settings"], self._settings()
        for key, flag in self.setting_flags.items():
            if saved.get(key) != now[key]:
                raise ValueError(f"the checkpoint's {self.name} state was saved with {flag} {saved[key]}, this run "
                                 f"has {now[key]}: its fragment schedule does not carry over")
        self.local_step = int(state["local_step"])
        self.last_start = [int(x) for x in state["last_start"]]
        self.last_land = [int(x) for x in state["last_land"]]
        self.dirty = [bool(x) for x in state["dirty"]]
        self.syncs = int(state["syncs"])
        self.due = [int(p) for p in state.get("due", [])]
        self.retries = int(state.get("retries", 0))
        self.finishing = bool(state.get("finishing", 0))
        if self.outer is not None:
            self.outer.load_state_dict(state["outer"])
        lane_views = [lv for v in self.views if not v.empty for lv in self.split.lane_views(v)] \
            if self.split.lanes else []
        self.compressors.load_state_dict(state["compressors"], {v.key: v for v in [*self.views, *lane_views]
                                                                if not v.empty}, self.device)
        self.in_flight = []
        for f in state["in_flight"]:
            side = None
            if f["has_side"]:
                side = SideValues(torch.zeros_like(f["side_mean"]))
                side.mean = f["side_mean"].to(self.device).clone()
            ticket = QueuedReduce.finished([m.to(self.device).clone() for m in f["mean"]])
            self.in_flight.append(InFlight(int(f["fragment"]), int(f["started"]), int(f["lands"]), ticket,
                                           Finished(ticket.result),  # decided (committed) before it was saved
                                           [s.to(self.device).clone() for s in f["snapshot"]], side))

    def stats(self) -> Dict[str, float]:
        stats = {"H": self.interval, "K": self.num_fragments, "fragment syncs": self.syncs}
        stats.update(compression_error([*self.fragment_compressors, *(c for cs in self.lane_compressors for c in cs)]))
        return stats
