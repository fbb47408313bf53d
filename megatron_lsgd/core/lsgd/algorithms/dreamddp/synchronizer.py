"""`dreamddp`: layer-wise partial parameter averaging after backward (DreamDDP; DESIGN.md §4.5).

Local SGD in which the model is not averaged all at once every H steps but unit by unit
(embedding, each transformer layer, the output head): over each period of H iterations
every unit is averaged across sites at least once, in the iterations a schedule assigns
to it. In such an iteration, unit l's average is launched as soon as l's backward of that
step is complete (`after_unit_backward`: its parameters are not read again before the
next forward), so it travels while the backward of the units below it still runs; every
average is waited for before the inner optimizer step (`after_forward_backward`).

What is averaged is the authoritative copy, in place: this rank's fp32 main slices of
the unit (`optimizer.views([unit]).main`), over dp_inter, one all-reduce per contiguous
range; no other memory is used. Under ZeRO-1 those slices are this rank's shard only;
the inner optimizer step that follows updates the main shard and all-gathers it into the
model (as every step does), so the averaged values reach every rank of the site without
an extra gather. With an fp32 model without ZeRO-1 the main slices are the parameters
themselves; bf16/fp16 models keep a separate fp32 main copy, cast into the model by the
same step. If an fp16 step is skipped (overflow), the averaged units are copied into the
model explicitly (`copy_main_to_model_params(views)`, an all-gather of just those units).

Order and deadlock freedom: the averages are issued in the schedule's backward order (a
unit whose hook fires early waits for the ones before it), so every rank of a dp_inter
group issues the same collectives in the same order; they run on a dp_inter group of
their own (`use_dedicated_group`), so nothing else (the log line's loss mean, the
intra-site reduces launched from the same hook with --overlap-grad-reduce, which use
dp_intra) can interleave with them.

Start-up: for the first `--lsgd-dreamddp-profile-steps` steps the equal-number schedule
runs (consecutive blocks of equal size, the paper's PLSGD-ENP: it needs no timings, moves
the steady state's bytes, and with H = 1 averages everything) while the profiler times
each unit's backward; then the link is probed, the profile is agreed (max over all ranks),
the schedule of every stage is computed on every rank from it (scheduler.py: DFS with the
paper's pruning rules, then bubble filling), printed, written with the profile to
dreamddp_profile.json next to the logs, and a new period starts. A unit whose last average
lies H iterations back when its new slot has not come yet is averaged in that iteration as
well (deadlines.py), so across the switch, as within a schedule, every unit is averaged at
least once in any H consecutive iterations. `--lsgd-dreamddp-schedule` replays that file
instead: no timing, the switch at its recorded iteration, its schedule as written, so a
run of the same seed trains exactly as the one that wrote it.
Warm-up steps (--lsgd-warmup-iters) average gradients instead, as in the other
local-SGD algorithms. When --train-iters is reached the whole model is averaged once, so
every site ends with the same model. Checkpoints hold the profile, the schedule, the
period's origin and when each unit was last averaged: a resumed run continues the same
schedule, it does not profile again.

Elastic sites (--lsgd-fault-tolerance torchft, docs/fault_tolerance.md): each period is a
round of the site membership (round.py), its quorum at its first step (where a returning
site is healed), decided after its last step; a schedule switch (the profile's, a
re-profile's, a pinned one's) ends the round it happens in, a checkpoint or an evaluation
(quiesce) ends the round under way. Every inter-site collective of the round runs `within`
it on the quorum's group: the per-unit averages issued from backward, the link probes and
the agreement of a profile (RoundComm). Not committed: every unit the round's schedule
reached (its average landed, failed or was not sent) goes back to its value just before its
first average of the round (a copy taken then: RoundUndo; at most this rank's averaged part
of the model, only under fault tolerance), and the schedule's state to the round's start, so
a switch whose agreement failed is retried. The closing average of
the whole model is a round of its own, tried again until it commits
(`SiteMembership.close_exchanges`). A plain run's membership commits every round and asks
for no undo state: the numbers and the memory are unchanged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections import deque
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_lsgd.core.lsgd.agreement import failed_anywhere_in_site
from megatron_lsgd.core.lsgd.algorithms.dreamddp.deadlines import Deadlines
from megatron_lsgd.core.lsgd.algorithms.dreamddp.plan import (Plan, StagePlan, build_plan, format_plan,
                                                   read_schedule_file)
from megatron_lsgd.core.lsgd.algorithms.dreamddp.profile import (BackwardRecorder, LocalMeasurement, Profile,
                                                      UnitProfile, agree_max, agree_profile, fit_link, global_index,
                                                      fastest_sample, probe_link, read_profile_file, stage_of)
from megatron_lsgd.core.lsgd.algorithms.dreamddp.round import RoundComm, RoundUndo
from megatron_lsgd.core.lsgd.algorithms.dreamddp.scheduler import SCHEDULERS
from megatron_lsgd.core.options import OptionGroup, option
from megatron_lsgd.core.lsgd.membership import Finished
from megatron_lsgd.core.lsgd.protocol import MicroBatch, SyncContext, Synchronizer
from megatron_lsgd.core.lsgd.registry import register
from megatron_lsgd.core.lsgd.site_split import SiteSplit, average_grads_across_sites
from megatron_lsgd.core.lsgd.warmup import SynchronousWarmup
from megatron_lsgd.core.output_files import write_json

PROFILE_FILE = "dreamddp_profile.json"


@dataclass
class DreamDDPOptions(OptionGroup):
    profile_steps: int = option("--lsgd-dreamddp-profile-steps", 3,
                                "start-up steps whose backward is timed per unit (they run the equal-number "
                                "schedule); the first is left out when there are several",
                                metavar="N")
    profile: Optional[str] = option("--lsgd-dreamddp-profile", None,
                                    "take the per-unit backward times, tails and link fit from this JSON (the "
                                    "dreamddp_profile.json of an earlier run) instead of profiling", type=str,
                                    metavar="JSON")
    schedule: Optional[str] = option("--lsgd-dreamddp-schedule", None,
                                     "run the schedule of an earlier run (its dreamddp_profile.json) instead of "
                                     "profiling: the equal-number schedule until the iteration that run switched, "
                                     "then its schedule, so two runs of one seed train alike", type=str,
                                     metavar="JSON")
    scheduler: str = option("--lsgd-dreamddp-scheduler", "dfs",
                            "dfs: the paper's depth-first search (least exposed time over contiguous "
                            "assignments); equal: consecutive blocks of equal size (the paper's PLSGD-ENP)",
                            choices=tuple(SCHEDULERS))
    no_bubble_fill: bool = option("--lsgd-dreamddp-no-bubble-fill", False,
                                  "do not add units to iterations whose communication still hides")
    reprofile_interval: int = option("--lsgd-dreamddp-reprofile-interval", 0,
                                     "every N steps (a multiple of --lsgd-interval; 0: never) compare the measured "
                                     "backward and exposed times with the profile; if they drifted, probe the link "
                                     "again and reschedule", metavar="N")
    reprofile_tolerance: float = option("--lsgd-dreamddp-reprofile-tolerance", 0.25,
                                        "relative drift of the backward time, or exposed time beyond the "
                                        "prediction by this share of the backward time, that triggers a re-profile")

    def validate(self, config, num_sites: int, run=None, **_) -> None:
        if self.profile_steps < 1:
            raise ValueError(f"--lsgd-dreamddp-profile-steps must be >= 1 (got {self.profile_steps})")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"--lsgd-dreamddp-scheduler {self.scheduler!r}: choose one of {', '.join(SCHEDULERS)}")
        if self.reprofile_interval < 0:
            raise ValueError(f"--lsgd-dreamddp-reprofile-interval must be >= 0 (got {self.reprofile_interval})")
        if self.reprofile_interval and self.reprofile_interval % config.rounds.interval:
            raise ValueError(f"--lsgd-dreamddp-reprofile-interval {self.reprofile_interval} must be a multiple of "
                             f"--lsgd-interval {config.rounds.interval} (a new schedule starts with a new period)")
        if not self.reprofile_tolerance > 0:
            raise ValueError(f"--lsgd-dreamddp-reprofile-tolerance must be > 0 (got {self.reprofile_tolerance})")
        if self.schedule is not None:
            self._check_schedule_file(config, run)
        if self.profile is not None:
            parsed = read_profile_file(self.profile)
            layers = run.num_layers if run is not None else None
            stages = run.pipeline_stages if run is not None else None
            if layers is not None:
                wanted = ["embedding"] + [f"layers.{i}" for i in range(layers)] + ["output"]
                missing = [n for n in wanted if n not in parsed["backward_ms"]]
                if missing:
                    raise ValueError(f"--lsgd-dreamddp-profile {self.profile}: has no backward time for "
                                     f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} (it was "
                                     f"written for another model; --num-layers {layers})")
            if stages is not None and len(parsed["tails_ms"]) != stages:
                raise ValueError(f"--lsgd-dreamddp-profile {self.profile}: written for {len(parsed['tails_ms'])} "
                                 f"pipeline stages, this run has --pipeline-model-parallel-size {stages}")

    def _check_schedule_file(self, config, run) -> None:
        for flag, given in (("--lsgd-dreamddp-profile", self.profile is not None),
                            ("--lsgd-dreamddp-reprofile-interval", self.reprofile_interval > 0)):
            if given:  # a profile would be scheduled anew; a re-profile reads the real clock again
                raise ValueError(f"--lsgd-dreamddp-schedule and {flag} exclude each other: a pinned schedule is "
                                 f"neither rescheduled nor re-profiled")
        _, plan, _ = read_schedule_file(self.schedule)
        where = f"--lsgd-dreamddp-schedule {self.schedule}"
        if plan.interval != config.rounds.interval:
            raise ValueError(f"{where}: written for --lsgd-interval {plan.interval}, this run has "
                             f"{config.rounds.interval}")
        if run is not None and run.pipeline_stages is not None and len(plan.stages) != run.pipeline_stages:
            raise ValueError(f"{where}: written for {len(plan.stages)} pipeline stages, this run has "
                             f"--pipeline-model-parallel-size {run.pipeline_stages}")
        if run is not None and run.num_layers is not None:
            names = {n for st in plan.stages for n in st.names}
            wanted = {"embedding", "output"} | {f"layers.{i}" for i in range(run.num_layers)}
            if not names <= wanted or not names >= wanted - {"output"}:
                raise ValueError(f"{where}: its units {sorted(names)} are not this model's (--num-layers "
                                 f"{run.num_layers})")


@register
class DreamDDP(SynchronousWarmup, Synchronizer):
    """Average each layer across sites right after its backward, in iterations a profiled schedule picks"""

    name = "dreamddp"
    fault_tolerance_refusal = None  # a period is a round of the membership (round.py), its collectives `within` it
    unequal_sites_refusal = ("its per-layer averages, launched from backward, run on one dp_inter group, not cut "
                             "into lanes yet")
    state_follows_pipeline = True  # the plan schedules each stage's units
    Options = DreamDDPOptions
    uses = frozenset({"rounds"})
    inert_with_one_site = True
    uses_unit_backward_hooks = True

    def __init__(self, ctx: SyncContext):
        super().__init__(ctx)
        cfg = ctx.config
        self.opts: DreamDDPOptions = cfg.algo
        self.interval = cfg.rounds.interval
        pgs = ctx.pgs
        self.stage, self.num_stages = pgs.pp_rank, pgs.dims.pp
        trainable = [u for u in ctx.units if any(p.requires_grad for p in u.parameters())]
        self.units = {u.name: u for u in trainable}
        self.names = [u.name for u in reversed(trainable)]  # backward order
        self.num_layers = len(ctx.layer_indices) * self.num_stages
        # Without ZeRO-1 every rank of a site holds the same full copy: each then averages
        # only its 1/DP_intra part of a unit across sites (no link carries a byte twice) and
        # the site re-assembles the parts with one all-gather before the optimizer step.
        self.split = SiteSplit(pgs, ctx.optimizer.sharded)
        self.full_views = {name: ctx.optimizer.views([u]) for name, u in self.units.items()}
        self.views = {name: self.split.mine(v) for name, v in self.full_views.items()}
        shards = ctx.optimizer.main_param_shards()
        self.device = shards[0].device if shards else torch.device("cpu")
        self.tied = self.num_stages > 1 and any(ctx.is_tied_embedding(p) for u in trainable for p in u.parameters())
        first_module = self.units[self.names[0]].modules[-1] if self.names else None
        self.recorder = BackwardRecorder(self.names, ctx.clock, first_module)
        if self.active:  # averages are issued from the backward: keep them off the shared dp_inter group
            ctx.comm.use_dedicated_group(pgs.dims)
        # state (checkpointed)
        self.profile: Optional[Profile] = None  # None while profiling
        # until then the equal-number schedule, which needs no timings (with the tied rule)
        self.plan: Plan = build_plan(self._untimed_profile(), self.interval, "equal", False)
        self.origin = self.warmup_iters  # first iteration of the first period
        self.deadlines: Optional[Deadlines] = Deadlines(self.names, self.warmup_iters)  # when each unit was averaged
        self.profile_steps_done = 0
        # --lsgd-dreamddp-schedule: the iteration from which the file's schedule runs
        self._pinned_origin = read_schedule_file(self.opts.schedule)[2] if self.opts.schedule is not None else 0
        self.samples: List[Dict] = []  # profiling: (step ordinal, iteration, timings)
        self.monitor: List[Dict] = []  # re-profiling window
        self.monitor_exposed_s = 0.0
        self.monitor_steps = 0
        self.reprofiles = 0
        self.local_measurement: Optional[LocalMeasurement] = None  # this rank's own, before agreement
        # this step
        self.queue: List[str] = []
        self.current = frozenset()
        self.completed: set = set()
        self.next_issue = 0
        self.handles: List[object] = []
        self.averaged: List[str] = []
        self.timing = False
        self.blocking_sample = False
        self.slot = -1
        self.history: deque = deque(maxlen=4096)  # (iteration, units averaged): tests and tools read it
        self._exposed_before = 0.0
        # Rounds (round.py; membership.py's Exchanges): a round is due to open at the next step,
        # the membership's ticket of the round under way, and the closing average of the whole
        # model (finish_training), which is a round of its own.
        self.due = True
        self.round = None
        self.finishing = False
        self.final_due = False
        self.undo = RoundUndo(self)
        self.iteration = 0  # the step under way (a heal at its quorum moves it to the peer's)
        self.next_iteration: Optional[int] = None  # the step after the last one taken (state: a heal carries it)
        self._healed_to: Optional[int] = None
        # --lsgd-ft-digests: sites hold different models between averages; what they hold alike is
        # each unit's value right after its last average (SHA-256 of this rank's part, per unit)
        self.digesting = False
        self.averaged_digests: Dict[str, str] = {}

    # ---- which units this step ---------------------------------------------------------------
    @property
    def profiling(self) -> bool:
        return self.profile is None

    def _untimed_profile(self) -> Profile:
        """Every stage's units with no times (what every rank knows without measuring)."""
        names = ["embedding"] + [f"layers.{i}" for i in range(self.num_layers)] + ["output"]
        units = [UnitProfile(n, stage_of(global_index(n, self.num_layers), self.num_layers, self.num_stages),
                             0.0, 0, 0) for n in names]
        return Profile(units, [0.0] * self.num_stages, 0.0, 0.0, self.tied, source="none (equal-number schedule)")

    def _to_average(self, iteration: int) -> List[str]:
        if self.in_warmup(iteration):
            return []
        self.slot = (iteration - self.origin) % self.interval
        if self.deadlines is None:  # resumed from a checkpoint that kept no deadlines
            self.deadlines = Deadlines.of_steady_schedule(self.names, self.plan.stages[self.stage].slots, self.origin,
                                                          iteration)
        return self.deadlines.with_overdue(self.plan.slot_units(self.stage, self.slot), iteration, self.interval)

    def before_forward_backward(self, iteration: int) -> None:
        if not self.active:
            return
        if not self.in_warmup(iteration):
            # A round due opens here: a fixed set of sites at once; elastic sites after the
            # step's quorum, where a returning site is healed (and then trains the peer's step).
            self._healed_to = None
            if self.due:
                self.ctx.membership.taken(self)
            self.ctx.membership.step_started(self)
            if self.ended() is not None:  # healed to the job's final state, or through its closing average
                return
            if self._healed_to is not None:
                iteration = self._healed_to
        self.iteration = iteration
        if self.profiling and self.opts.profile is not None:
            self._plan_from_file(iteration)
        if self.profiling and self.opts.schedule is not None and iteration >= self._pinned_origin:
            self._pinned_plan(iteration)
        self.slot = -1
        chosen = set(self._to_average(iteration))
        self.queue = [n for n in self.names if n in chosen]
        self.current = frozenset(self.queue)
        self.completed = set()
        self.next_issue = 0
        self.averaged = []
        self.handles = []
        monitoring = not self.profiling and self.opts.reprofile_interval > 0 and not self.in_warmup(iteration)
        profiling = self.profiling and self.opts.schedule is None  # a pinned schedule measures nothing
        self.timing = profiling or monitoring
        self.blocking_sample = profiling
        if self.timing:
            self.recorder.arm()
            self.recorder.begin_step()
        else:
            self.recorder.disarm()

    # ---- the partial synchronization -----------------------------------------------------------
    def after_unit_backward(self, unit, microbatch: MicroBatch) -> None:
        """On the thread that runs autograd (see protocol.py): launch this unit's average, and
        any later one in the queue whose backward already completed, in backward order."""
        if not self.active:
            return
        if self.timing:
            self.recorder.unit_done(unit.name)
        if unit.name in self.current:
            self.completed.add(unit.name)
            self._issue(force=False)

    def _issue(self, force: bool) -> None:
        comm = self.ctx.comm
        while self.next_issue < len(self.queue) and (force or self.queue[self.next_issue] in self.completed):
            name = self.queue[self.next_issue]
            self.next_issue += 1
            self.undo.keep(name, self.views[name], self.full_views[name])  # before the in-place average
            for main in self.views[name].main:
                # None: the round failed (nothing more is sent; it rolls back when decided)
                handle = self.ctx.membership.within(self.round, lambda main=main: comm.all_reduce_mean(main,
                                                                                                     async_op=True))
                if handle is not None:
                    self.handles.append(handle)
            self.averaged.append(name)

    def after_forward_backward(self, iteration: int) -> None:
        if not self.active:
            return
        iteration = self.iteration
        if self.timing:
            self.recorder.wait_reached()
        if self.in_warmup(iteration):
            average_grads_across_sites(self.ctx)
        self._exposed_before = self.ctx.comm.exposed_seconds
        self._issue(force=True)  # units whose hook did not fire (none in a normal step)
        for handle in self.handles:
            self.ctx.membership.within(self.round, handle.wait)
        self.handles = []
        self._digest(self.averaged)
        if self.averaged:
            self.split.gather([m for n in self.averaged for m in self.full_views[n].main])
        if self.timing:
            sample = self.recorder.sample(block=self.blocking_sample)
            if self.profiling:
                self.samples.append({"ordinal": self.profile_steps_done, "iteration": iteration, "sample": sample})
            elif sample is not None:
                self.monitor.append(sample)
        if not self.profiling and self.opts.reprofile_interval > 0 and not self.in_warmup(iteration):
            self.monitor_exposed_s += self.ctx.comm.exposed_seconds - self._exposed_before
            self.monitor_steps += 1

    def after_optimizer_step(self, iteration: int, update_successful: bool) -> None:
        if not self.active:
            return
        iteration = self.iteration
        if self.averaged and not update_successful:
            # fp16 overflow: no step, so no main -> model copy; the averaged units must still reach the model
            opt = self.ctx.optimizer
            opt.copy_main_to_model_params(opt.views([self.units[n] for n in self.averaged]))
        self.history.append((iteration, tuple(self.averaged)))
        if self.deadlines is not None:
            self.deadlines.averaged(iteration, self.averaged)
        switched = False  # a switch (or its attempt) ends the round: the next one starts a new period
        if self.profiling and self.opts.schedule is None and self.opts.profile is None:
            self.profile_steps_done += 1
            if self.profile_steps_done >= self.opts.profile_steps:
                self._finish_profile(iteration)
                switched = True
        elif (self.opts.reprofile_interval > 0 and iteration + 1 > self.origin
              and (iteration + 1 - self.origin) % self.opts.reprofile_interval == 0
              and not self.in_warmup(iteration)):
            self._check_drift(iteration)
            switched = True
        self.next_iteration = iteration + 1
        pinned_next = self.profiling and self.opts.schedule is not None and iteration + 1 >= self._pinned_origin
        if switched or pinned_next or (iteration + 1 - self.origin) % self.interval == 0:
            self._decide()

    def quiesce(self) -> None:
        for handle in self.handles:  # nothing is in flight between steps; kept for safety
            self.ctx.membership.within(self.round, handle.wait)
        self.handles = []
        # evaluation and checkpoints see decided state: the round under way ends here (a plain
        # run's rounds all commit, so this changes nothing there; the next step opens another)
        self._decide()

    def finish_training(self, iteration: int) -> None:
        """Average the whole model once, so every site ends with the same model: a round of its
        own after the one under way is decided, tried again until it commits."""
        if not self.active:
            return
        self.final_due = True
        self.ctx.membership.close_exchanges(self)

    # ---- rounds: what the membership's rhythm drives (membership.py's Exchanges) ----------------
    def _open_round(self) -> None:
        self.due = False
        # every average is waited for in its step: nothing is left to wait for at the decision
        self.round = self.ctx.membership.start(lambda: Finished(True), undo=[self.undo])

    def _decide(self) -> bool:
        """The round under way is over: the membership decides it (not committed: RoundUndo
        put its averaged units and the schedule back). True when committed (or none open)."""
        if self.round is None:
            return True
        ticket, self.round = self.round, None
        committed = self.ctx.membership.finish(ticket) is not None
        self.undo.release()
        self.due = True
        return committed

    def _round_ok(self) -> bool:
        """Whether the round can still commit on every rank of the site: asked before the
        schedule acts on agreed values, so that the site's ranks, whose later collectives
        inside the site follow those values, all act or all skip (one failed link suffices)."""
        return not failed_anywhere_in_site(self.ctx.membership.within(self.round, lambda: True, False), self.ctx.pgs,
                                           self.device)

    def _round_comm(self) -> RoundComm:
        return RoundComm(self.ctx.comm, self.ctx.membership, self.round)

    def publish(self, names) -> None:
        """`names` (units, or "whole" for the model) changed on this rank's part: the site
        gathers the parts (when split) and the model takes the main parameters."""
        if not names:
            return
        opt = self.ctx.optimizer
        if "whole" in names:
            self.split.gather(opt.views().main)
            opt.copy_main_to_model_params()
            return
        self.split.gather([m for n in names for m in self.full_views[n].main])
        opt.copy_main_to_model_params(opt.views([self.units[n] for n in names]))

    def _digest(self, names) -> None:
        if not self.digesting:
            return
        for name in names:
            h = hashlib.sha256()
            for main in self.views[name].main:
                h.update(main.detach().to("cpu").contiguous().numpy().tobytes())
            self.averaged_digests[name] = h.hexdigest()

    def held_alike(self) -> List[torch.Tensor]:
        """Each unit's value right after its last average, as digests (asked for at every
        quorum under --lsgd-ft-digests; from the first ask on, every average is hashed)."""
        self.digesting = True
        text = "".join(f"{n}:{self.averaged_digests.get(n, '')};" for n in self.names)
        return [torch.tensor(list(text.encode()), dtype=torch.uint8)]  # host bytes, only hashed (never sent)

    def exchange_due(self) -> bool:
        return self.due

    def issue_due(self) -> None:
        self._open_round()

    def decide_open(self) -> None:
        self._decide()

    def land_in_flight(self) -> None:
        self._decide()

    def closing_due(self) -> bool:
        return self.final_due

    def close_one(self) -> None:
        """The closing average of the whole model, a round of its own. Not committed: the
        model is back as it was, and the membership tries again."""
        self._open_round()
        opt, comm = self.ctx.optimizer, self.ctx.comm
        whole = opt.views()
        mine = self.split.mine(whole)
        self.undo.keep("whole", mine, whole)
        handles = [self.ctx.membership.within(self.round, lambda main=main: comm.all_reduce_mean(main, async_op=True))
                   for main in mine.main]
        for handle in handles:
            if handle is not None:
                self.ctx.membership.within(self.round, handle.wait)
        self.split.gather(whole.main)
        opt.copy_main_to_model_params()
        self._digest(self.names)  # (after the gather: a unit's part need not lie in this rank's part of the model)
        if self._decide():
            self.final_due = False
            comm.rounds += 1

    def closed(self) -> None:
        pass

    # ---- profiling ----------------------------------------------------------------------------------
    def _local_sizes(self):
        sizes = {n: 4 * v.numel for n, v in self.views.items()}
        ranges = {n: len(v.ranges) for n, v in self.views.items()}
        return sizes, ranges

    def _finish_profile(self, iteration: int) -> None:
        self.recorder.disarm()
        usable = [s for s in self.samples if s["sample"] is not None
                  and not (s["ordinal"] == 0 and self.opts.profile_steps > 1)]
        backward, tail = fastest_sample([s["sample"] for s in usable], self.names)
        sizes, ranges = self._local_sizes()
        link = probe_link(self._round_comm(), max(sizes.values(), default=0), self.device)
        latency, slope = fit_link(link)
        local = LocalMeasurement(backward, sizes, ranges, tail, latency, slope, self.tied)
        self.local_measurement = local
        profile = agree_profile(local, self.stage, self.num_stages, self.num_layers, self.ctx.pgs,
                                self._round_comm(), self.device)
        if not self._round_ok():  # not agreed: the round rolls back to profiling, and the switch is retried
            return
        profile.measured_steps = [s["iteration"] for s in usable]
        self.samples = []
        self._adopt(profile, iteration + 1, link_samples=link,
                    header=f"profiled over steps {[i + 1 for i in profile.measured_steps]}, agreed as the maximum "
                           f"over all ranks")

    def _plan_from_file(self, iteration: int) -> None:
        parsed = read_profile_file(self.opts.profile)
        sizes, ranges = self._local_sizes()
        backward = {n: parsed["backward_ms"][n] / 1e3 for n in self.names}
        local = LocalMeasurement(backward, sizes, ranges, parsed["tails_ms"][self.stage] / 1e3,
                                 parsed["latency_ms"] / 1e3, parsed["ms_per_MB"] / 1e3 / 2**20, self.tied)
        profile = agree_profile(local, self.stage, self.num_stages, self.num_layers, self.ctx.pgs,
                                self._round_comm(), self.device)
        if not self._round_ok():  # not agreed: the round rolls back, and the next one reads the file again
            return
        profile.source = self.opts.profile
        self._adopt(profile, iteration, link_samples=None, header=f"profile read from {self.opts.profile}")

    def _pinned_plan(self, iteration: int) -> None:
        """--lsgd-dreamddp-schedule: the run that wrote the file switched to its schedule here."""
        parsed, plan, origin = read_schedule_file(self.opts.schedule)
        sizes, ranges = self._local_sizes()
        backward = {n: parsed["backward_ms"][n] / 1e3 for n in self.names}
        local = LocalMeasurement(backward, sizes, ranges, parsed["tails_ms"][self.stage] / 1e3,
                                 parsed["latency_ms"] / 1e3, parsed["ms_per_MB"] / 1e3 / 2**20, self.tied)
        profile = agree_profile(local, self.stage, self.num_stages, self.num_layers, self.ctx.pgs,
                                self._round_comm(), self.device)  # for the printout and a checkpoint; the plan is the file's
        if not self._round_ok():  # not agreed: the round rolls back, and the next one switches again
            return
        profile.source = self.opts.schedule
        self._adopt(profile, origin, link_samples=None, plan=plan,
                    header=f"schedule read from {self.opts.schedule} (pinned: the schedule of the run that wrote it, "
                           f"not rescheduled)")

    def _adopt(self, profile: Profile, origin: int, link_samples, header: str, plan: Optional[Plan] = None) -> None:
        self.profile = profile
        self.plan = plan if plan is not None else build_plan(profile, self.interval, self.opts.scheduler,
                                                             not self.opts.no_bubble_fill)
        self.origin = max(self.warmup_iters, origin)
        self._announce(header + f"; periods start at iteration {self.origin + 1}", link_samples)

    def _announce(self, header: str, link_samples=None) -> None:
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        print(format_plan(self.plan, self.profile, header), flush=True)
        out_dir = self.ctx.config.output_dir
        if not out_dir:
            return
        os.makedirs(out_dir, exist_ok=True)
        doc = {"profile": self.profile.to_dict(), "schedule": self.plan.to_dict(), "origin_iteration": self.origin,
               "reprofiles": self.reprofiles,
               "link_probes_rank0": [{"bytes": n, "ms": 1e3 * s} for n, s in link_samples or []]}
        write_json(os.path.join(out_dir, PROFILE_FILE), doc, indent=1)

    # ---- re-profiling on drift ---------------------------------------------------------------------
    def _check_drift(self, iteration: int) -> None:
        """At a period boundary, every --lsgd-dreamddp-reprofile-interval steps: agree on the
        recent backward times and exposed time; if they moved away from the profile's by more
        than the tolerance, probe the link again and reschedule (from the next iteration, a
        new period). Every decision is taken on agreed values, so all ranks take it together."""
        usable = self.monitor
        backward, tail = fastest_sample(usable, self.names) if usable else (
            {u.name: u.backward_s for u in self.profile.units if u.name in self.units},
            self.profile.tails_s[self.stage])
        exposed = self.monitor_exposed_s / max(1, self.monitor_steps)
        self.monitor, self.monitor_exposed_s, self.monitor_steps = [], 0.0, 0
        sizes, ranges = self._local_sizes()
        local = LocalMeasurement(backward, sizes, ranges, tail, self.profile.latency_s, self.profile.seconds_per_byte,
                                 self.tied)
        recent = agree_profile(local, self.stage, self.num_stages, self.num_layers, self.ctx.pgs,
                               self._round_comm(), self.device)
        measured_exposed = agree_max([exposed], self.ctx.pgs, self._round_comm(), self.device)[0]
        # (a failed agreement: the ranks of the site skip the rest alike; the round rolls back)
        if not self._round_ok() or not drifted(self.profile, self.plan, recent, measured_exposed,
                                               self.opts.reprofile_tolerance):
            return
        link = probe_link(self._round_comm(), max(sizes.values(), default=0), self.device)
        latency, slope = fit_link(link)
        local.latency_s, local.seconds_per_byte = latency, slope
        profile = agree_profile(local, self.stage, self.num_stages, self.num_layers, self.ctx.pgs,
                                self._round_comm(), self.device)
        if not self._round_ok():
            return
        profile.source = f"re-profiled at iteration {iteration + 1}"
        self.reprofiles += 1
        self._adopt(profile, iteration + 1, link_samples=link,
                    header=f"re-profiled at iteration {iteration + 1} (measured exposed "
                           f"{1e3 * measured_exposed:.2f} ms/step)")

    # ---- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> Dict:
        self.require_quiesced(self.round is not None or bool(self.handles))  # (quiesce decides the round)
        return {"version": 2,
                "profile": dataclasses.asdict(self.profile) if self.profile is not None else {},
                "plan": dataclasses.asdict(self.plan),
                "origin": self.origin, "profile_steps_done": self.profile_steps_done,
                "samples": json.dumps(self.samples), "monitor": json.dumps(self.monitor),
                "monitor_exposed_s": self.monitor_exposed_s, "monitor_steps": self.monitor_steps,
                "reprofiles": self.reprofiles,
                "last_averaged": self.deadlines.state_dict() if self.deadlines is not None else {},
                # rounds (what a heal at a quorum carries: the step the peer starts, and whether
                # it is in the closing average), and the digests of the last averages
                "rounds": {"due": int(self.due), "finishing": int(self.finishing), "final_due": int(self.final_due),
                           "next_iteration": -1 if self.next_iteration is None else self.next_iteration},
                "averaged_digests": dict(self.averaged_digests)}

    def load_state_dict(self, state: Dict) -> None:
        if not state:
            return
        rounds = state.get("rounds", {})  # (absent before dreamddp was elastic: a round due, as at a start)
        self.due, self.round, self.handles = bool(rounds.get("due", 1)), None, []
        self.finishing, self.final_due = bool(rounds.get("finishing", 0)), bool(rounds.get("final_due", 0))
        step = int(rounds.get("next_iteration", -1))
        self.next_iteration = self._healed_to = None if step < 0 else step
        self.averaged_digests = dict(state.get("averaged_digests", {}))
        self.origin = int(state["origin"])
        self.profile_steps_done = int(state["profile_steps_done"])
        self.samples = json.loads(state["samples"])
        self.monitor = json.loads(state["monitor"])
        self.monitor_exposed_s = float(state["monitor_exposed_s"])
        self.monitor_steps = int(state["monitor_steps"])
        self.reprofiles = int(state["reprofiles"])
        if state.get("last_averaged"):
            self.deadlines = Deadlines(self.names, self.warmup_iters)
            self.deadlines.load_state_dict(state["last_averaged"])
        else:  # a version 1 checkpoint: derived from its schedule at the next step
            self.deadlines = None
        q = state["plan"]
        self.plan = Plan(q["interval"], q["method"], q["bubble_fill"], [StagePlan(**s) for s in q["stages"]])
        if not state["profile"]:  # saved while profiling: the remaining profiling steps run after the resume
            if self.plan.interval != self.interval:
                self.plan = build_plan(self._untimed_profile(), self.interval, "equal", False)
            return
        p = state["profile"]
        self.profile = Profile([UnitProfile(**u) for u in p["units"]], list(p["tails_s"]), p["latency_s"],
                               p["seconds_per_byte"], p["tied_embeddings"], p["source"], list(p["measured_steps"]))
        note = "restored from the checkpoint"
        if self.opts.profile is not None:
            note += f" (--lsgd-dreamddp-profile {self.opts.profile} is not read: a resumed run keeps its schedule)"
        if self.opts.schedule is not None:  # the interval was checked against the file at start-up
            note += f" (--lsgd-dreamddp-schedule {self.opts.schedule}: the checkpoint's schedule runs on)"
        elif (self.plan.interval, self.plan.method, self.plan.bubble_fill) != \
                (self.interval, self.opts.scheduler, not self.opts.no_bubble_fill):
            self.plan = build_plan(self.profile, self.interval, self.opts.scheduler, not self.opts.no_bubble_fill)
            note += "; recomputed from the checkpoint's profile for this run's --lsgd-interval / scheduler flags"
        if self.active:
            self._announce(note + f"; periods start at iteration {self.origin + 1}")

    def stats(self) -> Dict[str, float]:
        stats: Dict[str, float] = {"H": self.interval}
        if not self.active:
            return stats
        if self.slot >= 0:
            stats["slot"] = self.slot + 1
        stats["synced units"] = len(self.averaged)
        if self.profiling:
            stats["profiling step"] = self.profile_steps_done
            return stats
        st = self.plan.stages[self.stage]
        stats["pred exposed ms"] = 1e3 * sum(st.exposed_s) / self.interval
        if self.opts.reprofile_interval:
            stats["reprofiles"] = self.reprofiles
        return stats


def drifted(profile: Profile, plan: Plan, recent: Profile, measured_exposed_s: float, tolerance: float) -> bool:
    """True when a stage's agreed recent backward time moved by more than `tolerance`
    (relative), or the measured exposed time per step is off the prediction by more than
    `tolerance` x the predicted time of the backward phase (backward + tail + exposed), in
    either direction: a slower link costs time, a faster one leaves room to average more."""
    for stage in range(profile.num_stages):
        old = sum(profile.problem(stage).backward)
        new = sum(recent.problem(stage).backward)
        if old > 0 and abs(new - old) > tolerance * old:
            return True
    predicted = max(sum(st.exposed_s) / plan.interval for st in plan.stages)
    phase = max(profile.problem(s).deadline for s in range(profile.num_stages)) + predicted
    return abs(measured_exposed_s - predicted) > tolerance * phase


__all__ = ["DreamDDP", "DreamDDPOptions", "drifted", "global_index"]
