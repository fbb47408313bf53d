"""`a-edit`: EDiT with a wall-clock sync interval instead of a step count (A-EDiT; DESIGN.md
§4.4). Not lockstep: a fast site takes more inner steps than a slow one.

After every inner step each site checks its own clock: when τ (`--lsgd-aedit-interval-seconds`)
has passed since the last sync, the site's ranks agree on it (a MAX over the site's group,
a few bytes on the fast network) and the site enters a *meeting*: a blocking all-gather
over dp_inter of what the site did (steps, samples, why it came). That collective is the
barrier: a fast site waits there for the others, at most about one step of the slowest
site. What follows is EDiT's: the penalty's norms are gathered and every unit is synced
layer by layer in the next forward pass (edit.py). Every site restarts its clock when that
forward pass has synced its units, so τ is local training time: a sync that takes longer
than τ (a slow link) does not make the next one due at once.

Meetings are also where the run stops or pauses, by the shared rule
(protocol.stop_at_meeting), and where the loop evaluates and saves. A site enters a meeting
early when
- the job's budget (--train-samples / --train-tokens, or --train-iters x global batch: for
  a non-lockstep run --train-iters is the number of *global* batches to train on) would be
  exhausted by another global batch, as far as it can tell: total at the last sync plus
  its own samples since, scaled by the sites' step ratio of the last interval;
- its --exit-duration-in-mins has passed (a pause: nothing is synced, the interval's elapsed
  time is saved and the interval continues after the resume).
So that the budget is met exactly rather than overshot by an interval, a sync meeting that
finds the remaining budget within 1.5 intervals of the sites' last step counts gives each
site a step quota for a final interval instead of the clock: shares of the remaining site
steps proportional to the steps each site took last time (at least one each); the sites
meet again when each has done its quota, and training ends there.

Elastic sites (--lsgd-fault-tolerance torchft, docs/fault_tolerance.md): a meeting is a round
of the site membership. A site that enters it takes the quorum first (the barrier the
all-gather was: the lighthouse holds it until the sites of the last quorum come, or its join
timeout passes), where a returning site is healed; the report gather runs within the round on
the quorum's group (its rows: `round_sites()`), and the sync it decides is the round's
reduction, committed or rolled back as edit's (round.py); a lost round also restarts the
interval. The budget, the quotas and the stop rule read the reports of the round's sites only:
the job's samples are a count carried in the state (`sync_samples`, committed at each sync)
plus each present site's samples since its last sync, so a lost site's samples since its last
sync are not counted, and nothing is counted twice; the final interval's quotas are shared by
the sites present. A process's first step is followed by a quorum of its own (a restarted site
is healed there; if the others came to meet, it takes part in their meeting at once, sending,
for that sync, the Δ of the peer it was healed from, and reporting no samples). A healed site
takes its peer's model, optimizer, schedule and job count, but not the peer's pace: it goes on
reading its own stream from its own iteration and samples at the last sync it took part in
(`healed_position`, read by the meeting loop); its interval starts with the sync, as every
site's does.

Test hook: MEGATRON_LSGD_TEST_VIRTUAL_CLOCK="t0,t1,..." replaces the wall clock by one that
advances t_s seconds per inner step on site s (and serves --exit-duration-in-mins), which
makes a run deterministic, so resumed runs can be compared bit for bit with uninterrupted
ones.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_lsgd.core.lsgd.agreement import agree_in_site, failed_anywhere_in_site
from megatron_lsgd.core.lsgd.algorithms.edit.edit import EDiT, EDiTOptions
from megatron_lsgd.core.options import option
from megatron_lsgd.core.lsgd.protocol import Meeting, Progress, Stop, SyncContext, stop_at_meeting
from megatron_lsgd.core.lsgd.registry import register

VIRTUAL_CLOCK_ENV = "MEGATRON_LSGD_TEST_VIRTUAL_CLOCK"
QUOTA_HORIZON = 1.5  # plan the final interval when the rest of the budget is within this many intervals
# What a site reports at a meeting (one float64 each, gathered across the round's sites): why it
# came (no flag: an elastic process's first quorum), its steps and samples so far, its steps
# since its last sync, and its samples since its last sync (what the job has not counted yet).
_DUE_INTERVAL, _DUE_QUOTA, _DUE_BUDGET, _TIME_UP, _ITERATION, _SAMPLES, _STEPS, _NEW, _FIELDS = range(9)


@dataclass
class AEDiTOptions(EDiTOptions):
    interval_seconds: float = option("--lsgd-aedit-interval-seconds", 600.0,
                                     "tau_time: seconds of local training on each site between syncs (a fast site "
                                     "takes more steps)", metavar="SECONDS")

    def validate(self, config, num_sites: int, run=None, **context) -> None:
        super().validate(config=config, num_sites=num_sites, run=run, **context)
        if not self.interval_seconds > 0:
            raise ValueError(f"--lsgd-aedit-interval-seconds must be > 0 (got {self.interval_seconds})")
        flag = run.batch_schedule_flag if run is not None else None
        if flag:  # the meetings' budget arithmetic and final-interval quotas count fixed site batches
            raise ValueError(f"{flag} with --lsgd-algorithm a-edit is not supported: its sites take different "
                             f"numbers of steps and share the budget in fixed site batches; drop {flag}")
        if "--lsgd-interval" in config.rounds.changed_flags():
            raise ValueError("--lsgd-interval does not apply to --lsgd-algorithm a-edit, which syncs by time: use "
                             "--lsgd-aedit-interval-seconds")


def allocate_quota(remaining_steps: int, last_steps: Sequence[int]) -> List[int]:
    """Split `remaining_steps` site steps into per-site quotas proportional to `last_steps`
    (at least 1 each; largest remainders first, ties to the lower site): the sites then meet
    again at about the same time."""
    s = len(last_steps)
    if remaining_steps < s:
        raise ValueError(f"{remaining_steps} steps cannot give {s} sites one each")
    weights = [max(int(n), 1) for n in last_steps]
    spare = remaining_steps - s
    total = sum(weights)
    exact = [spare * w / total for w in weights]
    quota = [1 + int(e) for e in exact]
    left = remaining_steps - sum(quota)
    order = sorted(range(s), key=lambda i: (-(exact[i] - int(exact[i])), i))
    for i in order[:left]:
        quota[i] += 1
    return quota


class VirtualClock:
    """Advances a fixed number of seconds per inner step (MEGATRON_LSGD_TEST_VIRTUAL_CLOCK)."""

    def __init__(self, seconds_per_step: float):
        self.seconds_per_step = seconds_per_step
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def tick(self) -> None:
        self.t += self.seconds_per_step


def make_clock(site: int, run_clock):
    """The run's clock, unless the test hook replaces it (one fixed step time per site)."""
    spec = os.environ.get(VIRTUAL_CLOCK_ENV)
    if not spec:
        return run_clock
    return VirtualClock(float(spec.split(",")[site]))


@register
class AEDiT(EDiT):
    """EDiT synced by wall-clock interval: fast sites take more steps, nobody waits for a straggler"""

    name = "a-edit"
    fault_tolerance_refusal = None  # a meeting is a round: its quorum the barrier, its sync edit's (module docstring)
    unequal_sites_refusal = ("its sites take their own numbers of steps, so a site's weight would be its tokens at "
                             "each meeting, which is not implemented")
    Options = AEDiTOptions
    lockstep = False
    requires_multiple_sites = True

    def __init__(self, ctx: SyncContext):
        super().__init__(ctx)
        self.tau = ctx.config.algo.interval_seconds
        self.clock = make_clock(self.site, ctx.clock)
        self.virtual = isinstance(self.clock, VirtualClock)
        self.interval_start = self.clock.now()
        self.steps_in_interval = 0  # local steps since the last sync
        self.sync_samples = 0  # the job's samples at the last sync (each counted once)
        self.own_samples_at_sync = 0  # this site's samples then
        # every site's (iteration, samples) at the last sync it took part in: where a site
        # healed after a loss goes on reading its own stream (healed_position)
        self.synced_iterations = [0] * self.num_sites
        self.synced_samples = [0] * self.num_sites
        self.last_interval_steps: List[int] = []  # every site's steps in the last finished interval
        self.quota: Optional[List[int]] = None  # the final interval's per-site step quotas
        self.meetings = 0
        self._meeting: Optional[Meeting] = None
        self._restart_clock = False  # a sync is due in the next forward: the interval starts after it

    def after_optimizer_step(self, iteration: int, update_successful: bool) -> None:
        if self.virtual:
            self.clock.tick()
        if self.warming_up(iteration, self.outer, self.ctx.optimizer.views()):
            if iteration == self.warmup_iters - 1:  # the first interval starts with the local phase
                self.interval_start = self.clock.now()
            return
        self.steps_in_interval += 1

    def before_forward_backward(self, iteration: int) -> None:
        """Nothing: a-edit's rounds are its meetings (agree_to_stop), not a step's start."""

    def restart_from_anchors(self) -> None:
        """A lost round (elastic sites): every unit back at its anchor, and the interval starts
        again from there (its samples stay counted: they were consumed)."""
        super().restart_from_anchors()
        self.steps_in_interval = 0
        self.interval_start = self.clock.now()
        self._restart_clock = False

    # ---- meetings --------------------------------------------------------------------------------
    def _site_vote(self, flags: torch.Tensor) -> None:
        agree_in_site(flags, self.ctx.pgs, dist.ReduceOp.MAX)

    def agree_to_stop(self, progress: Progress) -> Optional[Stop]:
        self._meeting = None
        s, gbs = self.num_sites, progress.global_batch_size
        budget = progress.train_samples if progress.train_samples is not None else progress.train_iters * gbs
        local = progress.iteration > self.warmup_iters
        if self.warmup_iters and progress.iteration == self.warmup_iters:  # lockstep until now: exact totals
            self.sync_samples, self.own_samples_at_sync = progress.site_samples * s, progress.site_samples
            self.synced_iterations = [progress.iteration] * s
            self.synced_samples = [progress.site_samples] * s
        membership = self.ctx.membership
        if not membership.joined:  # an elastic process's first quorum, where a restarted site is healed
            stop = self._meet(progress, torch.zeros(4, dtype=torch.float64, device=self.device), budget)
            if membership.ended_by is not None:  # healed to the job's final state
                return Stop(True, membership.ended_by.reason())
            if self._meeting is not None:  # healed into the others' meeting, and took part in it
                return stop
        elapsed_since_start = self.clock.now() if self.virtual else progress.elapsed_s
        own_since = progress.site_samples - self.own_samples_at_sync
        last = self.last_interval_steps
        ratio = sum(last) / last[self.site] if last and last[self.site] > 0 else float(s)
        flags = torch.zeros(4, dtype=torch.float64, device=self.device)
        flags[_DUE_INTERVAL] = local and self.quota is None and self.clock.now() - self.interval_start >= self.tau
        flags[_DUE_QUOTA] = local and self.quota is not None and self.steps_in_interval >= self.quota[self.site]
        flags[_DUE_BUDGET] = self.quota is None and self.sync_samples + own_since * ratio > budget - gbs
        flags[_TIME_UP] = progress.exit_duration_s is not None and elapsed_since_start >= progress.exit_duration_s
        self._site_vote(flags)
        if not bool(flags.any()):
            return None
        stop = self._meet(progress, flags, budget)
        if membership.ended_by is not None:
            return Stop(True, membership.ended_by.reason())
        return stop

    def _meet(self, progress: Progress, flags: torch.Tensor, budget: int) -> Optional[Stop]:
        """A meeting: a round of the membership. Its quorum (elastic sites; a fixed set has
        none) is the barrier, where a returning site is healed; then every site's report is
        gathered on every rank of the round's sites, within the round (its rows in
        `round_sites()` order), and the sync it decides is the round's reduction (edit's:
        decided after the forward pass that carries it out). A site that came for its first
        quorum (no flag) takes part in a meeting only when another site came to meet;
        otherwise the round ends at once."""
        membership = self.ctx.membership
        healed = membership.round_started() is not None
        if membership.ended_by is not None:  # the job's final state: nothing left to meet about
            return None
        self._start_round()
        local = progress.iteration > self.warmup_iters
        mine = torch.zeros(_FIELDS, dtype=torch.float64, device=self.device)
        mine[:4] = flags
        if healed:  # a live peer's state (its Δ and steps, for this sync); its own stream position
            iteration, samples = self.healed_position()
            self.own_samples_at_sync = samples
        else:
            iteration, samples = progress.iteration, progress.site_samples
        mine[_ITERATION], mine[_SAMPLES], mine[_STEPS] = iteration, samples, self.steps_in_interval
        mine[_NEW] = samples - self.own_samples_at_sync
        order = list(membership.round_sites())
        out = torch.zeros(len(order) * _FIELDS, dtype=torch.float64, device=self.device)

        def gather() -> bool:
            self.ctx.comm.all_gather(out, mine)
            return True

        # every rank of the site decides alike, even when only some of its links failed
        if failed_anywhere_in_site(membership.within(self.round, gather, False), self.ctx.pgs, self.device):
            # the meeting is lost: the round is not committed, every unit back at its anchor
            self._decide()
            return None
        rows = dict(zip(order, out.view(len(order), _FIELDS).tolist()))
        if not any(any(r[:4]) for r in rows.values()):  # every site came for its first quorum: nothing to meet on
            self._decide()
            return None
        s, site_batch = self.num_sites, progress.global_batch_size // self.num_sites
        self.meetings += 1
        # every configured site's steps and samples: a site absent from the round as of its last sync
        iterations = tuple(int(rows[i][_ITERATION]) if i in rows else self.synced_iterations[i] for i in range(s))
        samples = tuple(int(rows[i][_SAMPLES]) if i in rows else self.synced_samples[i] for i in range(s))
        steps = [int(rows[i][_STEPS]) if i in rows else 0 for i in range(s)]
        # the job's samples: counted at the last sync, and since then by the sites present (a
        # lost site's samples since its last sync were never counted; a healed site reports none)
        counted = self.sync_samples + sum(int(r[_NEW]) for r in rows.values())
        due = any(r[_DUE_INTERVAL] or r[_DUE_QUOTA] or r[_DUE_BUDGET] for r in rows.values())
        meeting = Meeting(iterations, samples, time_up=any(r[_TIME_UP] for r in rows.values()), counted=counted)
        stop = stop_at_meeting(meeting, progress)
        ends = stop is not None and stop.ends_training
        sync = local and (due or (ends and any(steps)))
        if sync:
            # A pause meeting (time only) changes nothing here, so a resumed run continues
            # exactly as if it had not paused.
            self.last_interval_steps = steps
            self.sync_samples, self.own_samples_at_sync = counted, samples[self.site]
            for i in rows:
                self.synced_iterations[i], self.synced_samples[i] = iterations[i], samples[i]
            self.steps_in_interval = 0
            self.quota = None
            if stop is None:
                remaining = (budget - counted) // site_batch  # >= S: the rule above did not stop
                if QUOTA_HORIZON * sum(steps) >= remaining:
                    present = sorted(rows)  # the final interval's steps are shared by the sites present
                    quota = dict(zip(present, allocate_quota(remaining, [steps[i] for i in present])))
                    self.quota = [quota.get(i, 0) for i in range(s)]
            self._decide_units(steps)  # the sync, in the next forward (or quiesce / finish_training)
            self.interval_start = self.clock.now()
            self._restart_clock = True
        else:
            self._decide()  # nothing synced: the round ends here
        self._meeting = Meeting(iterations, samples, meeting.time_up, synced=sync, counted=counted)
        return stop

    def healed_position(self) -> Tuple[int, int]:
        """This site's own iteration and samples at the last sync it took part in: a site that
        was lost reads its stream again from there (what it read since was never counted)."""
        return self.synced_iterations[self.site], self.synced_samples[self.site]

    def after_forward_backward(self, iteration: int) -> None:
        super().after_forward_backward(iteration)
        if self._restart_clock and not self.pending:  # this forward synced every unit of the stage
            self.interval_start = self.clock.now()
            self._restart_clock = False

    def meeting(self) -> Optional[Meeting]:
        return self._meeting

    def finish_training(self, iteration: int) -> None:
        self._decide()  # the last meeting's sync (it ended training), if it has not run yet

    # ---- state and stats ---------------------------------------------------------------------------
    def state_dict(self) -> Dict:
        state = super().state_dict()
        state.update(interval_elapsed_s=self.clock.now() - self.interval_start,
                     steps_in_interval=self.steps_in_interval, sync_samples=self.sync_samples,
                     own_samples_at_sync=self.own_samples_at_sync, last_interval_steps=list(self.last_interval_steps),
                     synced_iterations=list(self.synced_iterations), synced_samples=list(self.synced_samples),
                     quota=list(self.quota) if self.quota is not None else [],
                     restart_clock=int(self._restart_clock))
        return state

    def load_state_dict(self, state: Dict) -> None:
        super().load_state_dict(state)
        self.interval_start = self.clock.now() - float(state["interval_elapsed_s"])
        self.steps_in_interval = int(state["steps_in_interval"])
        self.sync_samples = int(state["sync_samples"])
        self.own_samples_at_sync = int(state["own_samples_at_sync"])
        self.last_interval_steps = [int(n) for n in state["last_interval_steps"]]
        # (checkpoints written before these were kept: only a heal reads them)
        self.synced_iterations = [int(n) for n in state.get("synced_iterations", [0] * self.num_sites)]
        self.synced_samples = [int(n) for n in state.get("synced_samples", [0] * self.num_sites)]
        self.quota = [int(q) for q in state["quota"]] or None
        # saved at a sync meeting: the interval starts after the next forward (checkpoints
        # written before this was saved: their sync was still pending then)
        self._restart_clock = bool(state.get("restart_clock", self.pending))

    def stats(self) -> Dict[str, float]:
        stats = super().stats()
        stats.pop("H", None)
        stats.update({"interval s": self.tau, "meetings": self.meetings, "steps since sync": self.steps_in_interval})
        if self.quota is not None:
            stats["quota"] = self.quota[self.site]
        return stats
