"""`cocodc`: Streaming DiLoCo with delay compensation and adaptive transmission (Zhu et al.,
CoCoDC; DESIGN.md §4.3). Fragments, anchors, outer steps, compression and the τ-step
overlap are streaming-diloco's (`streaming.py`); two things change.

Delay compensation, instead of mixing by α. When fragment p's mean lands, τ steps after its
start: with s = θ_local,p when the sync started, u = θ_local,p now − s (the τ steps of local
progress) and d = θ_g,p(new) − s,

    θ_local,p ← θ_g,p(new) + u − (λ / (τ·H)) · u ⊙ u ⊙ d

a first-order Taylor correction of the local progress with a diagonal Fisher (u ⊙ u)
approximation of the Hessian (our reading of the paper's Eqs. 4-8, whose printed signs are
inconsistent: this is the one that keeps local progress). λ = 0 is "rebase the local
progress onto the new global fragment": θ_g,p(new) + u.

With Adam-sized steps u ⊙ u is ~1e-8, so the printed form is numerically inert (the
correction is ~1e-10 of d). `--lsgd-cocodc-dc-normalize mean-square` replaces the Fisher
term by u ⊙ u / v, v a per-element running mean square of u over the fragment's landings
(decay `--lsgd-cocodc-dc-beta`, bias-corrected), as DC-ASGD's adaptive form normalizes its
correction by a running mean square; the ratio is dimensionless (1 for a typical step), so
the correction becomes (λ τ / H) (u ⊙ u / v) ⊙ d, the paper's τ g_corr with g ⊙ g measured
in units of its own mean square: at λ 0.5, τ 5, H 100 about 2.5% of d per coordinate. It
costs one fp32 copy of this rank's fragment shards (v), saved with the checkpoint.

Adaptive transmission (`--lsgd-cocodc-schedule adaptive`, the default). N syncs per H steps,
one every h = ⌊H/N⌋ steps, with N = max(K, ⌊γ·H·T_c/T_s⌋) (T_c: mean inner step time,
T_s: mean time from issuing a fragment's reduction to seeing it complete, observed at the
step boundaries where the reduction is polled). At each sync slot the fragment is:
  1. skipped if in flight (several may be in flight when h <= τ);
  2. among the others, the one with the largest R_p = ||Δ̄_p|| / I_p (I_p: steps from p's
     previous landing to this sync's start; R_p = ∞ before p's first landing), unless
     taking it would leave some fragment more than H steps without a sync, in which case
     the fragment that needs it first goes (earliest deadline). The paper's "not synced for
     >= H steps goes first" only notices a late fragment once it is late and cannot promise
     what the paper claims for Eq. 9 ("at least all K fragments are synchronized once per H
     steps"); the deadline test is the latest point that still keeps that promise.
Ties go to the fragment that waited longest, then the lower index.

Every input of that choice is the same on every rank of every site, with no message of its
own across sites:
  - ||Δ̄_p|| is the norm of the fragment's mean, which every site holds bit-identically; the
    pieces of a fragment live on several ranks of a site (TP, PP, ZeRO-1), so each landing
    sums their squares with one small all-reduce inside the site (fast links only);
  - T_c and T_s are measured per rank, averaged inside the site by the same all-reduce, and
    sent to the other sites inside the payload of the next fragment sync (`SideValues`: two
    fp32 numbers riding uncompressed in the reduction's last collective). When that sync
    lands every rank holds the job's mean and recomputes N from it.
Sites of different data-parallel sizes: the fragments' means are streaming-diloco's, weighted
by tokens, lane by lane; their shards differ, so ||Δ̄_p||² is summed lane by lane in one order
on every site (SiteSplit.square_norm), and the job's times are read as every rank received
them (a site's sum over its ranks divided by their count need not give the same value back
when the sites' rank counts differ). The times ride weighted by the sites' tokens.
`--lsgd-cocodc-syncs-per-round N` fixes N (the paper's "initial benchmarking" option); only
then is the whole schedule independent of timing, and a resumed run repeats it exactly.
`--lsgd-cocodc-schedule round-robin` keeps streaming-diloco's fixed slots (delay
compensation only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence

import torch

from megatron_lsgd.core.lsgd.agreement import agree_in_site
from megatron_lsgd.core.lsgd.means import SideValues
from megatron_lsgd.core.options import option
from megatron_lsgd.core.lsgd.protocol import SyncContext
from megatron_lsgd.core.lsgd.registry import register
from megatron_lsgd.core.lsgd.algorithms.streaming import FragmentOptions, InFlight, StreamingDiLoCo
from megatron_lsgd.core.optimizer.shard_views import sum_of_squares

SCHEDULES = ("adaptive", "round-robin")
DC_NORMALIZE = ("none", "mean-square")


@dataclass
class CoCoDCOptions(FragmentOptions):
    dc_lambda: float = option("--lsgd-cocodc-lambda", 0.5,
                              "lambda: strength of the delay compensation of the tau steps of local progress "
                              "(0: rebase them onto the new global fragment)", metavar="LAMBDA")
    gamma: float = option("--lsgd-cocodc-gamma", 0.4,
                          "gamma in (0, 1]: the adaptive schedule runs N = max(K, floor(gamma H T_comp / T_sync)) "
                          "fragment syncs per H steps", metavar="GAMMA")
    schedule: str = option("--lsgd-cocodc-schedule", "adaptive",
                           "adaptive: N syncs per H steps, the fragment chosen by staleness and pseudo-gradient "
                           "norm; round-robin: streaming-diloco's fixed slots (delay compensation only)",
                           choices=SCHEDULES)
    dc_normalize: str = option("--lsgd-cocodc-dc-normalize", "none",
                               "none: the paper's correction (lambda / (tau H)) u*u*d, inert at Adam-sized steps; "
                               "mean-square: (lambda tau / H) (u*u / v) * d, v a running mean square of u "
                               "(DC-ASGD's adaptive form)", choices=DC_NORMALIZE)
    dc_beta: float = option("--lsgd-cocodc-dc-beta", 0.95,
                            "mean-square normalization: decay of the running mean square of u per landing")
    syncs_per_round: int = option("--lsgd-cocodc-syncs-per-round", 0,
                                  "adaptive schedule: fix N instead of measuring step and sync times (0: measure)",
                                  metavar="N")

    def validate(self, config, num_sites: int, run=None, **_) -> None:
        super().validate(config=config, num_sites=num_sites, run=run)
        interval, k = config.rounds.interval, self.fragments
        if self.dc_lambda < 0:
            raise ValueError(f"--lsgd-cocodc-lambda must be >= 0 (got {self.dc_lambda})")
        if not 0 < self.gamma <= 1:
            raise ValueError(f"--lsgd-cocodc-gamma must be in (0, 1] (got {self.gamma})")
        if self.dc_normalize not in DC_NORMALIZE:
            raise ValueError(f"--lsgd-cocodc-dc-normalize {self.dc_normalize!r}: choose one of "
                             f"{', '.join(DC_NORMALIZE)}")
        if not 0 <= self.dc_beta < 1:
            raise ValueError(f"--lsgd-cocodc-dc-beta must be in [0, 1) (got {self.dc_beta})")
        if self.dc_beta != 0.95 and self.dc_normalize != "mean-square":
            raise ValueError("--lsgd-cocodc-dc-beta needs --lsgd-cocodc-dc-normalize mean-square")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--lsgd-cocodc-schedule {self.schedule!r}: choose one of {', '.join(SCHEDULES)}")
        if self.schedule == "round-robin" and interval % k:
            raise ValueError(f"--lsgd-interval {interval} must be a multiple of --lsgd-fragments {k} with "
                             f"--lsgd-cocodc-schedule round-robin: streaming-diloco's K slots of H/K steps")
        if self.syncs_per_round < 0:
            raise ValueError(f"--lsgd-cocodc-syncs-per-round must be >= 0 (got {self.syncs_per_round}; 0: measure)")
        if self.syncs_per_round:
            if self.schedule != "adaptive":
                raise ValueError("--lsgd-cocodc-syncs-per-round needs --lsgd-cocodc-schedule adaptive")
            if not k <= self.syncs_per_round <= interval:
                raise ValueError(f"--lsgd-cocodc-syncs-per-round {self.syncs_per_round} must be in [K, H] = "
                                 f"[--lsgd-fragments {k}, --lsgd-interval {interval}]")


# ---- the adaptive rules (pure functions; tested on their own) -------------------------------------
def syncs_per_round(fragments: int, interval: int, gamma: float, step_seconds: float, sync_seconds: float) -> int:
    """Eq. 9: N = max(K, ⌊γ·H·T_c/T_s⌋), at most one sync per step; K until both are known."""
    if step_seconds <= 0 or sync_seconds <= 0:
        return fragments
    return max(fragments, min(interval, math.floor(gamma * interval * step_seconds / sync_seconds)))


def _deadlines_hold(t: int, chosen: int, interval: int, slot_max: int, last_start: Sequence[int],
                    available_at: Mapping[int, int]) -> bool:
    """With `chosen` starting at t, can every other fragment still start within `interval` steps
    of its last start? Earliest-deadline-first over the coming slots, spaced `slot_max` apart
    (the widest spacing the schedule may use, so a denser schedule only does better); a
    fragment in flight can start again from the step it lands."""
    pending = {p: last_start[p] + interval for p in range(len(last_start)) if p != chosen}
    slot = t
    for _ in range(2 * len(last_start) + 1):
        if not pending:
            return True
        slot += slot_max
        if any(deadline < slot for deadline in pending.values()):
            return False
        ready = [p for p in pending if available_at.get(p, t) <= slot]
        if ready:
            del pending[min(ready, key=lambda p: (pending[p], p))]
    return not pending


def choose_fragment(t: int, interval: int, slot_max: int, ratios: Sequence[float], last_start: Sequence[int],
                    available_at: Mapping[int, int]) -> Optional[int]:
    """The fragment whose sync starts at local step t, or None when every fragment is in flight.

    `ratios`: R_p (∞ before p's first landing); `last_start`: local step of p's last start (0
    = the anchor); `available_at`: in-flight fragment -> the step it lands."""
    eligible = [p for p in range(len(ratios)) if p not in available_at]
    if not eligible:
        return None
    for p in sorted(eligible, key=lambda q: (-ratios[q], last_start[q], q)):
        if _deadlines_hold(t, p, interval, slot_max, last_start, available_at):
            return p
    return min(eligible, key=lambda q: (last_start[q] + interval, q))


def _moving_average(old: float, new: float, weight: float = 0.25) -> float:
    """Exponential moving average of measured seconds; 0 means "none yet" on either side."""
    if new <= 0:
        return old
    return new if old <= 0 else (1 - weight) * old + weight * new


# ---- the algorithm --------------------------------------------------------------------------------
@register
class CoCoDC(StreamingDiLoCo):
    """Streaming DiLoCo with Taylor delay compensation and adaptive fragment transmission"""

    name = "cocodc"
    unequal_sites_refusal = None  # streaming-diloco's weighted lane-by-lane fragment means; exact norms by lane

    @classmethod
    def refused_with_elastic_unequal_sites(cls, config) -> List:
        if config.algo.dc_normalize != "none":
            # a rank whose part of a fragment is empty keeps no mean square for it, and counts no landing
            return [(f"--lsgd-cocodc-dc-normalize {config.algo.dc_normalize}",
                     "its running mean squares are kept per rank's part of a fragment, which a heal into a site "
                     "of another size does not re-cut yet")]
        return []
    Options = CoCoDCOptions
    fault_tolerance_refusal = None  # its rounds run through SiteMembership's quorums

    def __init__(self, ctx: SyncContext):
        super().__init__(ctx)
        algo = ctx.config.algo
        self.dc_lambda = algo.dc_lambda
        self.dc_normalize = algo.dc_normalize == "mean-square"
        self.dc_beta = algo.dc_beta
        self.dc_mean_sq: Dict[int, List[torch.Tensor]] = {}  # fragment -> running mean square of u per range
        self.dc_landings: Dict[int, int] = {}
        self.adaptive = algo.schedule == "adaptive"
        self.measuring = self.adaptive and algo.syncs_per_round == 0
        self.num_syncs = algo.syncs_per_round or self.num_fragments  # N
        self.slot = max(1, self.interval // self.num_syncs)  # h
        self.next_start = max(1, self.interval // self.num_fragments - self.tau)
        self.ratios = [math.inf] * self.num_fragments  # R_p
        self.spans = [ctx.optimizer.counted_spans(v) for v in self.views]  # a norm counts each value once
        # sites whose rank counts differ would sum a norm, or the job's times, in another order
        dims = ctx.pgs.dims
        self.uneven_sites = len({dims.ranks_of_site(s) for s in range(dims.sites)}) > 1
        # measured times (seconds): this rank's, the site's (sent with the next sync), the job's
        self.step_seconds_sum, self.step_count = 0.0, 0
        self.site_step_seconds = self.site_sync_seconds = 0.0
        self.job_step_seconds = self.job_sync_seconds = 0.0

    # ---- schedule ------------------------------------------------------------------------------------
    def starts_at(self, t: int) -> List[int]:
        if not self.adaptive:
            return super().starts_at(t)
        if t < self.next_start:
            return []
        self.next_start = t + self.slot
        p = choose_fragment(t, self.interval, self.interval // self.num_fragments, self.ratios, self.last_start,
                            {r.fragment: r.lands for r in self.in_flight})
        return [] if p is None else [p]

    def times_steps(self) -> bool:
        return self.measuring

    def record_step_time(self, seconds: float) -> None:
        if self.measuring:
            self.step_seconds_sum += seconds
            self.step_count += 1

    def side_values(self) -> Optional[SideValues]:
        if not self.measuring:
            return None
        return SideValues(torch.tensor([self.site_step_seconds, self.site_sync_seconds], dtype=torch.float32))

    snapshots = True

    def snapshot(self, p: int) -> List[torch.Tensor]:
        return [m.to(self.device, copy=True) for m in self.views[p].main]

    # ---- landing: delay compensation, then the schedule's bookkeeping ------------------------------
    @torch.no_grad()
    def merge(self, rec: InFlight, mean: List[torch.Tensor], t: int) -> bool:
        views = self.views[rec.fragment]
        tau = t - rec.started  # τ, or fewer steps when finish_training lands it early
        if views.empty:
            return tau > 0
        progress = [m.to(self.device) - s for m, s in zip(views.main, rec.snapshot)]  # u, before the outer step
        self.outer.step(views, mean)
        coef = self.dc_lambda / (tau * self.interval) if tau > 0 else 0.0
        scales: List[Optional[torch.Tensor]] = [None] * len(progress)
        if coef and self.dc_normalize:
            coef = self.dc_lambda * tau / self.interval
            scales = self._mean_square(rec.fragment, progress)
        for m, a, s, u, v in zip(views.main, self.outer.anchor(views), rec.snapshot, progress, scales):
            target = torch.add(a, u, out=m) if m.device == a.device else a + u  # λ = 0: exactly a + u
            if coef:
                corr = (a - s).mul_(u).mul_(u)
                if v is not None:
                    corr.div_(v)
                target.sub_(corr.mul_(coef))  # (λ / (τH)) u ⊙ u ⊙ d, or (λτ / H) (u ⊙ u / v) ⊙ d
            if target is not m:
                m.copy_(target)
        return tau > 0

    def _mean_square(self, p: int, progress: List[torch.Tensor]) -> List[torch.Tensor]:
        """Update fragment p's running mean square of u with this landing's u; return it
        bias-corrected (plus a floor, so a coordinate that never moved divides 0 by it)."""
        if p not in self.dc_mean_sq:
            self.dc_mean_sq[p] = [torch.zeros_like(u) for u in progress]
        n = self.dc_landings[p] = self.dc_landings.get(p, 0) + 1
        out = []
        for v, u in zip(self.dc_mean_sq[p], progress):
            v.mul_(self.dc_beta).addcmul_(u, u, value=1 - self.dc_beta)
            out.append((v / (1 - self.dc_beta ** n)).clamp_(min=1e-30))
        return out

    def after_landing(self, rec: InFlight, mean: List[torch.Tensor], t: int) -> None:
        if not self.adaptive:
            return
        p = rec.fragment
        device = self.ctx.optimizer.main_param_shards()[0].device  # the site group is NCCL on GPUs
        lane_norm = self.split.square_norm(self.views[p], mean, self.spans[p], device) if self.split.lanes else None
        values = [0.0 if lane_norm is not None else sum_of_squares(mean, self.spans[p]), 0.0, 0.0, 0.0, 0.0, 0.0]
        if self.measuring:
            if self.step_count:
                values[1] = self.step_seconds_sum / self.step_count
            seconds = rec.ticket.seconds
            if seconds is not None and not self.views[p].empty:
                values[2], values[3] = seconds, 1.0
            if rec.side is not None and rec.side.mean is not None:
                values[4], values[5] = rec.side.mean[:2].tolist()  # one read back, not one per value
        agreed = torch.tensor(values, dtype=torch.float64, device=device)
        n = agree_in_site(agreed, self.ctx.pgs)
        agreed = agreed.tolist()  # one device sync for the six values
        if lane_norm is not None:
            agreed[0] = lane_norm
        self.ratios[p] = math.sqrt(agreed[0]) / max(1, rec.started - self.last_land[p])
        if not self.measuring:
            return
        self.step_seconds_sum, self.step_count = 0.0, 0
        self.site_step_seconds = agreed[1] / n
        if agreed[3] > 0:
            self.site_sync_seconds = agreed[2] / agreed[3]
        job = (agreed[4] / n, agreed[5] / n)
        if self.uneven_sites:  # as every rank received them: a site's (x + x + x) / 3 need not be x
            job = (values[4], values[5])
        # online moving averages of the job's times (identical inputs everywhere, so identical results)
        self.job_step_seconds = _moving_average(self.job_step_seconds, job[0])
        self.job_sync_seconds = _moving_average(self.job_sync_seconds, job[1])
        self.num_syncs = syncs_per_round(self.num_fragments, self.interval, self.ctx.config.algo.gamma,
                                         self.job_step_seconds, self.job_sync_seconds)
        self.slot = max(1, self.interval // self.num_syncs)

    # ---- state ----------------------------------------------------------------------------------------
    def state_dict(self) -> Dict:
        state = super().state_dict()
        if self.dc_normalize:
            state.update(dc_mean_sq={str(p): [v.clone() for v in vs] for p, vs in self.dc_mean_sq.items()},
                         dc_landings={str(p): n for p, n in self.dc_landings.items()})
        state.update(ratios=list(self.ratios), num_syncs=self.num_syncs, slot=self.slot, next_start=self.next_start,
                     step_count=self.step_count, step_seconds_sum=self.step_seconds_sum,
                     site_step_seconds=self.site_step_seconds, site_sync_seconds=self.site_sync_seconds,
                     job_step_seconds=self.job_step_seconds, job_sync_seconds=self.job_sync_seconds)
        return state

    def load_state_dict(self, state: Dict) -> None:
        super().load_state_dict(state)
        if self.dc_normalize:
            if "dc_mean_sq" not in state:
                raise ValueError("the checkpoint was saved without --lsgd-cocodc-dc-normalize mean-square")
            self.dc_mean_sq = {int(p): [v.to(self.device).clone() for v in vs] for p, vs in state["dc_mean_sq"].items()}
            self.dc_landings = {int(p): int(n) for p, n in state["dc_landings"].items()}
        self.ratios = [float(r) for r in state["ratios"]]
        self.num_syncs, self.slot = int(state["num_syncs"]), int(state["slot"])
        self.next_start, self.step_count = int(state["next_start"]), int(state["step_count"])
        for key in ("step_seconds_sum", "site_step_seconds", "site_sync_seconds", "job_step_seconds",
                    "job_sync_seconds"):
            setattr(self, key, float(state[key]))

    setting_flags = {**StreamingDiLoCo.setting_flags, "schedule": "--lsgd-cocodc-schedule"}

    def _settings(self) -> Dict:
        settings = super()._settings()
        settings.update(schedule=self.ctx.config.algo.schedule)
        return settings

    def stats(self) -> Dict[str, float]:
        stats = super().stats()
        if self.adaptive:
            stats.update({"N": self.num_syncs, "h": self.slot})
        return stats
