"""`dilocox`: DiLoCo with one-step-delay overlap, compressed pseudo-gradients and adaptive
compression (DiLoCoX; DESIGN.md §4.2).

Round t (H inner steps) ends with:
  1. Δ_t = θ_g − θ_local on this rank's shard;
  2. wait for Δ̄_{t−1}, whose compressed mean was started a round ago and advanced between
     the inner steps of round t (`before_forward_backward` polls it without blocking);
  3. θ_g ← OuterSGD(θ_g, Δ̄_{t−1})   (round 1 applies nothing);
  4. start the compressed mean of Δ_t (error feedback), to run during round t+1;
  (with --lsgd-adaptive, rank and H are adapted between 3 and 4, while the link is idle)
  5. start round t+1 from θ_g − Δ_t (`--lsgd-dilocox-restart eager`, default: keeps this
     site's own in-flight progress; Δ_{t+1} is then measured from that start) or from θ_g
     (`anchor`, DESIGN.md's literal rule).
With `--lsgd-dilocox-apply-step τ < H`, step 3 moves to τ inner steps into round t+1 (the
local replica moves with the anchor and keeps its progress), so sites train on their own
unaveraged progress for τ steps instead of H. When --train-iters is reached,
`finish_training` closes a partial last round, waits for the last mean, applies it and
loads the anchor: the final model is the same on every site.
The anchor only ever takes averaged steps, so it is bit-identical on every site.
Waiting before starting keeps a single reduction in flight, so every site issues its
inter-site collectives in the same order.

Where the mean is issued is the membership's rhythm (membership.py, `Exchanges`): the Δ
taken at a round's end is handed over (`taken`); a fixed set of sites issues it at once,
elastic sites (--lsgd-fault-tolerance torchft, docs/fault_tolerance.md) right after the
next round's quorum, at its first step (`step_started`), so a quorum never rebuilds the
group under a mean in flight and a returning site is healed at the start of a step: the
same numbers. The mean is decided (committed or not) where it is applied. Not committed:
the anchor stays, the error feedback is put back as it was when the mean was issued, and
the failed Δ is sent again with the next round's (the round keeps its local progress: the
next pseudo-gradient is the whole drift from the anchor). A site healed at a quorum sends,
for that one mean, the Δ of the peer it was healed from (as in torchft's Streaming
DiLoCo: that peer's data counts twice). The end of training is the membership's
`close_exchanges`, the same for every membership: the last mean, a round of its own, tried
again until it commits.

Sites of different TP x PP (docs/heterogeneous_sites.md): Δ crosses sites in the layout-free
form (CanonicalExchange, on lanes of its own): the site assembles it where the mean is
issued, the lanes' means overlap the next round, and the site reads it back where it is
applied (those two are site collectives on the compute thread, at step boundaries).
Sites of different data-parallel sizes: Δ's mean is weighted by the sites' tokens and runs
lane by lane on clones of the lane groups of its own (SiteSplit.lane_reduce), each lane by a
compressor of its own (int8/int4: both ends of a lane quantize the same values in the same
blocks), each site sending C(w_s x S x M) so the sites' plain mean is weighted by tokens (the
error feedback stays in M's units); low rank and top-k are refused with such sites (their
matrices and chunks are not cut into lanes yet). The adaptive H is agreed on every lane.

Adaptive rules (`--lsgd-adaptive`, logged as `rank` and `H`):
  rank: window of effective ranks of the reduced P (smallest k holding `energy` of its
        spectral energy, max over this rank's matrices); next rank = clamp(ceil(mean)).
        P is identical on every site, so sites agree without extra traffic.
  H:    hide-comm: smallest H with H · t_step ≥ slack · T_comm, T_comm = last measured
        transfer time scaled by the payload change; scale-with-rank: H = H0 · rank / rank0.
        Clamped to [h-min, h-max] and agreed (max) over the whole job with two 8-byte
        all-reduces (inside the site, then across sites), since rounds must line up.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_lsgd.core.lsgd.agreement import agree_max_in_job
from megatron_lsgd.core.lsgd.canonical_exchange import use_dedicated_lanes
from megatron_lsgd.core.lsgd.compressors import compression_error
from megatron_lsgd.core.lsgd.algorithms.diloco import LocalSGDBase
from megatron_lsgd.core.options import OptionGroup, option
from megatron_lsgd.core.lsgd.protocol import SyncContext
from megatron_lsgd.core.lsgd.reduction import PendingReduce
from megatron_lsgd.core.lsgd.registry import register

H_RULES = ("hide-comm", "scale-with-rank")


@dataclass
class DiLoCoXOptions(OptionGroup):
    restart: str = option("--lsgd-dilocox-restart", "eager",
                          "where the next round starts: eager = anchor minus this site's own in-flight "
                          "pseudo-gradient, anchor = the (one round late) anchor itself", choices=("eager", "anchor"))
    apply_step: int = option("--lsgd-dilocox-apply-step", 0,
                             "apply round t's mean after TAU inner steps of round t+1 instead of at its end (0, "
                             "the default: TAU = H, DiLoCoX's one-round delay). A smaller TAU shortens the time "
                             "sites train on stale averages; the transfer must then hide in TAU steps",
                             metavar="TAU")
    adaptive: bool = option("--lsgd-adaptive", False, "adapt the low-rank rank and H every round")
    adaptive_energy: float = option("--lsgd-adaptive-energy", 0.9,
                                    "effective rank = smallest k holding this share of the reduced P's spectral "
                                    "energy")
    adaptive_window: int = option("--lsgd-adaptive-window", 5, "rounds averaged for the next rank")
    adaptive_min_rank: int = option("--lsgd-adaptive-min-rank", 1, "smallest rank the adaptive rule may pick")
    adaptive_h_rule: str = option("--lsgd-adaptive-h-rule", "hide-comm",
                                  "hide-comm: smallest H whose compute hides the measured transfer; "
                                  "scale-with-rank: H proportional to the current rank", choices=H_RULES)
    adaptive_h_min: Optional[int] = option("--lsgd-adaptive-h-min", None, "default: --lsgd-interval", type=int)
    adaptive_h_max: Optional[int] = option("--lsgd-adaptive-h-max", None, "default: 4 x --lsgd-interval", type=int)
    adaptive_h_slack: float = option("--lsgd-adaptive-h-slack", 1.2,
                                     "hide-comm: compute time must cover this multiple of the transfer time")

    def validate(self, config, num_sites: int, **_) -> None:
        interval, comp = config.rounds.interval, config.compression
        if self.restart not in ("eager", "anchor"):
            raise ValueError(f"--lsgd-dilocox-restart {self.restart!r}: choose eager or anchor")
        if self.apply_step < 0:
            raise ValueError(f"--lsgd-dilocox-apply-step must be >= 0 (got {self.apply_step}; 0 means H)")
        if self.apply_step > interval:
            raise ValueError(f"--lsgd-dilocox-apply-step {self.apply_step} must be <= --lsgd-interval {interval}")
        if not self.adaptive:
            return
        if not 0 < self.adaptive_energy <= 1:
            raise ValueError("--lsgd-adaptive-energy must be in (0, 1]")
        if self.adaptive_window < 1:
            raise ValueError("--lsgd-adaptive-window must be >= 1")
        if comp.kind == "lowrank-int4" and not 1 <= self.adaptive_min_rank <= comp.rank:
            raise ValueError(f"--lsgd-adaptive-min-rank must be in [1, --lsgd-rank {comp.rank}]")
        if self.adaptive_h_rule not in H_RULES:
            raise ValueError(f"--lsgd-adaptive-h-rule {self.adaptive_h_rule!r}: choose one of {', '.join(H_RULES)}")
        if self.adaptive_h_rule == "scale-with-rank" and comp.kind != "lowrank-int4":
            raise ValueError("--lsgd-adaptive-h-rule scale-with-rank needs --lsgd-compression lowrank-int4")
        if self.adaptive_h_min is None:
            self.adaptive_h_min = interval
        if self.adaptive_h_max is None:
            self.adaptive_h_max = 4 * interval
        if not 1 <= self.adaptive_h_min <= self.adaptive_h_max:
            raise ValueError(f"--lsgd-adaptive-h-min {self.adaptive_h_min} and --lsgd-adaptive-h-max "
                             f"{self.adaptive_h_max} must satisfy 1 <= min <= max")
        if self.adaptive_h_slack <= 0:
            raise ValueError("--lsgd-adaptive-h-slack must be > 0")


class _Unsent:
    """A mean's Δ as `undo` state: when the mean is not committed, the Δ is put back as not
    yet sent (carried into the next round's: no local progress lost, nothing counted twice).
    The compressors read Δ, they do not write it."""

    def __init__(self, sync: "DiLoCoX", deltas: List[torch.Tensor]):
        self.sync, self.deltas = sync, deltas

    def state_dict(self) -> Dict:
        return {"deltas": self.deltas}

    def load_state_dict(self, state: Dict) -> None:
        self.sync.carry = state["deltas"]


def _max_rank_allowed(layout) -> int:
    smallest = None
    for pieces in layout:
        for shape, *_ in pieces:
            if len(shape) >= 2:
                cols = math.prod(shape[1:])
                m = min(shape[0], cols)
                smallest = m if smallest is None else min(smallest, m)
    return smallest if smallest is not None else 2 ** 62


@register
class DiLoCoX(LocalSGDBase):
    """DiLoCo with one-round-delay overlap, compressed pseudo-gradients, adaptive rank and H"""

    name = "dilocox"
    unequal_sites_refusal = None  # weighted, lane by lane on lanes of its own (SiteSplit.lane_reduce)
    elastic_unequal_sites_refusal = None  # a heal re-cuts its Δ and means on the rank's part (per_part_state)
    unequal_sites_compressions = ("int8", "int4")  # a compressor per lane, each site's contribution scaled
    mixed_layouts_refusal = None  # Δ crosses sites in the layout-free form, on lanes of its own (CanonicalExchange)
    Options = DiLoCoXOptions
    requires_multiple_sites = True
    fault_tolerance_refusal = None  # its rounds run through SiteMembership's quorums

    @classmethod
    def refused_with_fault_tolerance(cls, config) -> List:
        if config.algo.adaptive:
            return [("--lsgd-adaptive", "its H is agreed across sites outside any quorum")]
        return []

    def __init__(self, ctx: SyncContext):
        super().__init__(ctx, energy=ctx.config.algo.adaptive_energy)
        cfg = ctx.config
        xcfg = cfg.algo
        layout = self.views.layout()
        if cfg.compression.kind == "lowrank-int4":
            # Every rank must reach the same verdict, or the healthy ranks would hang later.
            allowed = torch.tensor([_max_rank_allowed(layout)], dtype=torch.int64, device=ctx.device)
            if dist.is_initialized():
                dist.all_reduce(allowed, op=dist.ReduceOp.MIN)
            if cfg.compression.rank > int(allowed):
                raise ValueError(f"--lsgd-rank {cfg.compression.rank} is larger than the smallest weight matrix "
                                 f"dimension ({int(allowed)}) on some tensor/pipeline-parallel rank")
        if self.active:  # reductions advance between steps: keep them off the shared dp_inter groups
            use_dedicated_lanes(ctx, self.exchange, self.split)
        self.pending: Optional[PendingReduce] = None  # the mean in flight: the membership's ticket
        self.start_offsets: Optional[List[torch.Tensor]] = None
        # The round's Δ until the membership issues it (elastic sites: after the next round's
        # quorum; otherwise at once), a Δ whose mean was not committed (sent again with the
        # next round's), and whether the closing exchanges of finish_training are under way.
        self.outgoing: Optional[List[torch.Tensor]] = None
        self.carry: Optional[List[torch.Tensor]] = None
        self.finishing = False
        self.pending_round = -1  # which round's mean is in flight
        self.applied_rounds: List[int] = []  # round whose mean each outer step applied (-1: none)
        self.rank_window: deque = deque(maxlen=xcfg.adaptive_window)
        self.initial_rank = self.compressor.rank
        # timing for the hide-comm rule
        self._round_compute = 0.0
        self._step_start: Optional[float] = None
        self._comm_issued = 0.0
        self._comm_seconds = 0.0

    # ---- overlap ----------------------------------------------------------------------------
    def before_forward_backward(self, iteration: int) -> None:
        self._step_start = self.ctx.clock.now()
        if self.active:  # elastic sites: the round's quorum (a returning site is healed), then the last round's mean
            self.ctx.membership.step_started(self)
        if self.pending is not None and not self.pending.done and self.pending.poll():
            self._comm_seconds = self.ctx.clock.now() - self._comm_issued

    # ---- Exchanges: what the membership's rhythm drives (membership.py) ---------------------------
    def exchange_due(self) -> bool:
        return self.outgoing is not None

    def issue_due(self) -> None:
        deltas, self.outgoing = self.outgoing, None
        self._issue(deltas)

    def decide_open(self) -> None:
        """(A mean is decided where it is applied, before the next round's quorum; and by quiesce.)"""
        self._decide_pending()

    def land_in_flight(self) -> None:
        if self.pending is not None:  # (a final round shorter than τ) its mean first
            self._apply_pending_mean()
        if self.carry is not None:
            self.outgoing = self.carry if self.outgoing is None else [o + c for o, c in zip(self.outgoing, self.carry)]
            self.carry = None

    def closing_due(self) -> bool:
        return self.outgoing is not None

    def close_one(self) -> None:
        """The last round's mean, a round of its own; not committed: its Δ is due again."""
        self.issue_due()
        if not self._apply_pending_mean():
            self.outgoing, self.carry = self.carry, None

    def closed(self) -> None:
        self.restart_from_anchor()  # every site ends with the anchor: the same, fully averaged model

    def _issue(self, deltas: List[torch.Tensor]) -> None:
        """Start the compressed mean of Δ (of the round just closed). Not committed: the error
        feedback is put back, and Δ is carried into the next round's (`_Unsent`)."""
        self._comm_issued = self.ctx.clock.now()
        if self.exchange is not None:  # sites of different layouts: the site's scatter runs now, here
            reduction = self.exchange.issue(self.ctx.comm, self.views, deltas)
        elif self.lane_compressors:  # sites of different sizes: weighted, lane by lane
            reduction = self.split.lane_reduce(self.ctx.comm, self.views, deltas,
                                               [c.reduce for c in self.lane_compressors])
        else:
            reduction = self.compressor.reduce(deltas)
        self.pending = self.ctx.membership.start(lambda: PendingReduce(reduction),
                                                 undo=[self.compressor, *self.lane_compressors, _Unsent(self, deltas)])
        self.pending_round = self.outer_rounds - 1

    def after_optimizer_step(self, iteration: int, update_successful: bool) -> None:
        if self._step_start is not None:
            self._round_compute += self.ctx.clock.now() - self._step_start
        super().after_optimizer_step(iteration, update_successful)
        tau = min(self.ctx.config.algo.apply_step or self.interval, self.interval)
        if self.pending is not None and 0 < self.steps_in_round == tau:  # (τ = H is handled by end_round)
            self._apply_mean_mid_round()

    def _apply_pending_mean(self) -> bool:
        """Wait for the mean in flight (blocking time is exposed comm), take the outer step
        with it and forget the round's start offsets (they were relative to the old anchor).
        Not committed (elastic sites): nothing moves, its Δ waits to be sent again. Returns
        whether the outer step was taken."""
        if not self.pending.done:
            self.pending.wait()
            self._comm_seconds = self.ctx.clock.now() - self._comm_issued
        mean = self.ctx.membership.finish(self.pending)
        applied = mean is not None
        if applied and self.exchange is not None:  # its lanes, read back here: every rank of the site is here
            mean = self.exchange.land(self.views, mean)
        if applied:
            self.outer.step(self.views, mean)
            self.applied_rounds.append(self.pending_round)
            self.start_offsets = None
        self.pending, self.pending_round = None, -1
        return applied

    def _apply_mean_mid_round(self) -> None:
        """--lsgd-dilocox-apply-step τ < H: take the outer step with round t's mean now and move
        the local replica by the same amount, keeping this round's progress so far; the rest
        of the round is then measured from the new anchor."""
        shards, anchors = self.views.main, self.outer.anchor(self.views)
        offsets = self.start_offsets or [None] * len(shards)
        progress = [s.to(a.device) - (a if off is None else a - off)
                    for s, a, off in zip(shards, anchors, offsets)]
        if not self._apply_pending_mean():  # not committed: the anchor did not move, nor does the replica
            return
        for s, a, p in zip(shards, anchors, progress):
            s.copy_(a + p)
        self.publish()

    def end_round(self) -> None:
        deltas = self.outer.pseudo_gradient(self.views)
        if self.start_offsets is not None:  # the round started at θ_g − offset, not at θ_g
            for d, off in zip(deltas, self.start_offsets):
                d.sub_(off)
        if self.pending is not None:
            self._apply_pending_mean()
        elif not self.applied_rounds:
            self.applied_rounds.append(-1)  # round 1 has nothing to apply
        if self.carry is not None:  # a mean that did not commit: its Δ goes again with this round's
            for d, c in zip(deltas, self.carry):
                d.add_(c)
            self.carry = None
        if self.ctx.config.algo.adaptive:
            # Before issuing the new reduction: the link is idle now, so the small H
            # agreement is not queued behind a bulk transfer on a bandwidth-limited link.
            self._adapt()
        self.outgoing = deltas
        self.ctx.membership.taken(self)  # issued now, or (elastic sites) after the next round's quorum
        if self.ctx.config.algo.restart == "eager":
            # Start the next round from θ_g − Δ_t (own, not yet averaged progress) instead of
            # θ_g, so a round does not redo the progress still in flight; the anchor itself
            # only ever takes averaged, identical-on-every-site steps.
            self.start_offsets = [d.clone() for d in deltas]
            for shard, a, d in zip(self.views.main, self.outer.anchor(self.views), deltas):
                shard.copy_(a - d)
            self.publish()
        else:
            self.restart_from_anchor()
        self._round_compute = 0.0

    def quiesce(self) -> None:
        """Let the mean in flight land (it is applied at its usual step, not now) and decide it
        (elastic sites: committed or not), so a checkpoint holds a committed mean or none."""
        if self.pending is not None and not self.pending.done:
            self.pending.wait()
            self._comm_seconds = self.ctx.clock.now() - self._comm_issued
        self._decide_pending()

    def _decide_pending(self) -> None:
        if self.pending is not None and self.ctx.membership.finish(self.pending) is None:
            self.pending, self.pending_round = None, -1  # not committed: its Δ goes again (carry)

    def finish_training(self, iteration: int) -> None:
        super().finish_training(iteration)
        # The last round's mean would otherwise never be applied: apply it and load the anchor,
        # so every site ends with the same, fully averaged model (membership.close_exchanges).
        if self.active and (self.outgoing is not None or self.pending is not None or self.carry is not None):
            self.ctx.membership.close_exchanges(self)

    # ---- adaptive rank and H --------------------------------------------------------------------
    def _adapt(self) -> None:
        cfg = self.ctx.config.algo
        comp = self.ctx.config.compression
        old_rank = self.compressor.rank
        new_rank = old_rank
        if comp.kind == "lowrank-int4" and self.compressor.last_effective_ranks:
            self.rank_window.append(max(self.compressor.last_effective_ranks))
            mean = sum(self.rank_window) / len(self.rank_window)
            new_rank = max(cfg.adaptive_min_rank, min(self.compressor.max_rank, math.ceil(mean)))
        if cfg.adaptive_h_rule == "scale-with-rank":
            proposal = round(self.ctx.config.rounds.interval * new_rank / max(1, self.initial_rank))
        else:
            bytes_before = self.compressor.payload_bytes_per_round()
            self.compressor.rank = new_rank
            bytes_after = self.compressor.payload_bytes_per_round()
            self.compressor.rank = old_rank
            t_step = self._round_compute / max(1, self.interval)
            t_comm = self._comm_seconds * bytes_after / max(1, bytes_before)
            proposal = math.ceil(cfg.adaptive_h_slack * t_comm / t_step) if t_step > 0 else self.interval
        proposal = max(cfg.adaptive_h_min, min(cfg.adaptive_h_max, proposal))
        self.interval = self._agree_max(proposal)
        if new_rank != old_rank:
            self.compressor.set_rank(new_rank)

    def _agree_max(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.float64, device=self.ctx.device)  # site group: NCCL on GPUs
        agree_max_in_job(t, self.ctx.pgs, self.ctx.comm, self.split.lanes)
        return int(t.item())

    # ---- state and stats -------------------------------------------------------------------------
    def state_dict(self) -> Dict:
        # A checkpoint holds the finished mean (applied at its usual step after a resume);
        # quiesce() finished it, and with it the error-feedback update.
        self.require_quiesced(self.pending is not None and not self.pending.done)
        state = self._base_state()
        state.update(rank_window=list(self.rank_window),
                     pending_round=self.pending_round, applied_rounds=list(self.applied_rounds),
                     pending_mean=[m.clone() for m in self.pending.result] if self._has_mean() else [],
                     has_pending=int(self._has_mean()), comm_seconds=self._comm_seconds,
                     start_offsets=[o.clone() for o in self.start_offsets] if self.start_offsets else [])
        for key in ("outgoing", "carry"):  # elastic sites only (a plain run's state has neither)
            value = getattr(self, key)
            if value is not None:
                state[key] = [t.clone() for t in value]
        if self.finishing:
            state["finishing"] = 1
        return state

    def per_part_state(self, state: Dict) -> List[Tuple[List[torch.Tensor], object]]:
        # the mean in flight, the Δ taken and not yet issued or not committed, the eager restart's
        # offsets: each on this rank's part of the whole model
        return [(state[key], self.whole) for key in ("pending_mean", "start_offsets", "outgoing", "carry")
                if key in state]

    def _has_mean(self) -> bool:
        """A mean in flight (decided by quiesce: committed)."""
        return self.pending is not None

    def load_state_dict(self, state: Dict) -> None:
        self._load_base_state(state)
        self.rank_window = deque((int(r) for r in state["rank_window"]), maxlen=self.ctx.config.algo.adaptive_window)
        self.pending_round = int(state["pending_round"])
        self.applied_rounds = [int(r) for r in state["applied_rounds"]]
        self.pending = PendingReduce.finished([m.to(self.compressor.device) for m in state["pending_mean"]]) \
            if state["has_pending"] else None
        self._comm_seconds = float(state["comm_seconds"])
        offsets = state.get("start_offsets", state.get("eager_offsets"))  # renamed; older checkpoints
        self.start_offsets = [o.to(self.compressor.device) for o in offsets] if offsets else None
        for key in ("outgoing", "carry"):
            value = state.get(key)
            setattr(self, key, [t.to(self.compressor.device).clone() for t in value] if value is not None else None)
        self.finishing = bool(state.get("finishing", 0))

    def stats(self) -> Dict[str, float]:
        r = self.compressor
        stats = {"H": self.interval, "outer rounds": self.outer_rounds,
                 **compression_error([r, *self.lane_compressors])}
        if self.ctx.config.compression.kind == "lowrank-int4":  # rank means nothing for plain quantization
            stats["rank"] = r.rank
        return stats
