"""The non-lockstep training loop: sites take different numbers of steps and agree only where
they meet (every synchronizer with `lockstep = False`: a-edit).

- The job's length is a budget of samples (--train-samples / --train-tokens, or
  --train-iters global batches); each site's data stream is sized for the fastest site (one
  site could consume the whole budget), and a site that has taken all of it without the
  sites agreeing to stop is an error.
- The sites agree only at *meetings* the synchronizer holds in its own collectives (after
  every step, its stop rule, termination.MeetingTermination, asks it `agree_to_stop`, and
  the loop reads `meeting()`): the loop evaluates, saves and stops only there. The point
  is named by the job's progress (samples of all sites // global batch), which is also the
  checkpoint's iteration;
  --eval-interval, --save-interval and --exit-interval act at the first meeting at or past
  a multiple of it. Every site keeps its own iteration, LR schedule and sample position in
  the checkpoint.
- Every site's last rank logs its own line (its own steps, loss and tokens, tagged with the
  site, the job's agreed progress and every site's steps at the last meeting), with no
  cross-site collective.

The steps, evaluation, saving and log-line writing are the Trainer's (training.py), shared
with the lockstep loop (lockstep_loop.py); this module holds what meetings decide."""

from __future__ import annotations

from typing import Callable, Dict, Optional

from megatron_lsgd.core.lsgd.protocol import Meeting
from megatron_lsgd.training.logging_utils import print_rank
from megatron_lsgd.training.run_state import Interval, IntervalLine, Position, Run
from megatron_lsgd.training.termination import MeetingTermination, crossed


class MeetingLoop:
    """Its collaborators are explicit: the run's config and process groups, the Position it
    advances, the synchronizer (whose meetings it reads and which decides the stop), the LR
    scheduler (which follows the job's progress), and the clock and signals its stop rule
    reads; the Trainer's shared parts (a step, a log line, acting on decisions) are handed
    to `run`."""

    # The sites agreed the job's end at a meeting: a run resumed from that checkpoint takes
    # no step, so a checkpoint's `ended` is restored.
    resumes_ended = True

    def __init__(self, config, pgs, position: Position, synchronizer, scheduler, clock, signals=None):
        self.config, self.pgs, self.position = config, pgs, position
        self.synchronizer, self.scheduler = synchronizer, scheduler
        self.termination = MeetingTermination(config.training, synchronizer, clock, signals)
        site, t = pgs.site_rank, config.training
        ranks_per_site = config.dims.world_size // config.dims.sites
        self.line_rank = (site + 1) * ranks_per_site - 1  # this site's last rank (last stage) logs its line
        budget = t.train_samples if t.train_samples is not None else t.train_iters * t.global_batch_size
        self.site_step_cap = budget // (t.global_batch_size // config.dims.sites)  # all of the job's budget
        self.tags: Dict[str, int] = {"site": site}  # every site's records carry it
        self.where = f" on site {site}"
        self.last_meeting: Optional[Meeting] = None

    @property
    def checkpoint_iteration(self) -> int:
        """A checkpoint is named by the job's progress at the last meeting, in global batches."""
        return self.position.agreed_iteration

    def after_heal(self) -> None:
        """An elastic site took a live peer's state (elastic.py), its position included. The
        job's samples are the peer's (the job's at its last meeting), but its iteration and
        stream position are the peer's own pace: this site goes back to its own, as the job
        last counted them (`Synchronizer.healed_position`), and reads its stream from there."""
        pos = self.position
        pos.iteration, pos.site_consumed_samples = self.synchronizer.healed_position()
        pos.agreed_iteration = pos.consumed_samples // self.config.training.global_batch_size

    def run(self, run: Run, step: Callable, log: Callable, act: Callable) -> None:
        """Step; at a meeting take the job's agreed progress, and only there evaluate, save
        and stop (`step`, `log` and `act` are the Trainer's step, log_interval and act_on)."""
        pos, t, site = self.position, self.config.training, self.pgs.site_rank
        while not pos.ended:  # a resumed run whose training had already ended takes no step
            taken = step(run)
            if taken.ended is not None:  # training ended inside the step (no step taken): the final state is held
                return
            run.acc.gbs = self.count_job_samples(taken.site_samples, taken.same_on_every_site)
            stop = self.termination.after_step(pos.iteration, pos.site_consumed_samples)
            meeting = self.synchronizer.meeting()
            before = pos.agreed_iteration
            if meeting is not None:  # agreed on every rank
                self._agree(meeting)
                stop = self.termination.at_meeting(stop, before, pos.agreed_iteration)
            if pos.iteration % t.log_interval == 0 or stop is not None:
                log(run)
            eval_due = meeting is not None and crossed(before, pos.agreed_iteration, t.eval_interval)
            save_due = meeting is not None and crossed(before, pos.agreed_iteration,
                                                       self.config.checkpoint.save_interval)
            if act(run, stop, eval_due, save_due):
                if stop.ends_training:
                    print_rank(f"training ends at iteration {pos.iteration} of site {site} "
                               f"({stop.reason})", self.pgs.rank, self.line_rank)
                return
            if pos.iteration >= self.site_step_cap:
                raise RuntimeError(f"--lsgd-algorithm {self.config.lsgd.algorithm}: site {site} took "
                                   f"{pos.iteration} steps, all its data, without the sites agreeing to stop")

    def _agree(self, meeting: Meeting) -> None:
        """The job's progress is the meeting's: every site's samples together."""
        self.last_meeting = meeting
        self.position.consumed_samples = meeting.samples
        self.position.agreed_iteration = meeting.samples // self.config.training.global_batch_size
        if meeting.synced:  # not at a pause's extra meeting: a resumed run stays exact
            self._follow_job_schedule(meeting)

    def _follow_job_schedule(self, meeting: Meeting) -> None:
        """A site's LR schedule is the job's, not its own step count's. Its schedule spans
        the job's --train-iters global batches, so a fast site counting its own steps would
        finish the decay early and run its last steps at --min-lr; at every meeting that
        syncs its position becomes the job's agreed progress (between them it advances one
        global batch per own step, as if every site kept its pace)."""
        self.scheduler.num_steps = meeting.samples if self.scheduler.by_samples \
            else meeting.samples // self.config.training.global_batch_size

    # ---- counting the job's samples ----------------------------------------------------------
    def count_job_samples(self, site_samples: int, same_on_every_site: bool) -> int:
        """The job's total is agreed at meetings only (_agree sets it); returns the step's
        global batch as if every site had computed as many."""
        return site_samples * self.config.dims.sites

    def settle_job_samples(self) -> None:
        """Nothing to settle: the job's total is the last meeting's."""

    # ---- the log line ------------------------------------------------------------------------
    def interval_line(self, acc: Interval) -> IntervalLine:
        """This site's own line: its samples, steps and losses, no cross-site collective (the
        sites are at different steps)."""
        pos, t, dims = self.position, self.config.training, self.config.dims
        means = {k: float((v / acc.iters).item()) for k, v in acc.sums.items()} if self.pgs.is_last_stage else {}
        lead = {"site": str(self.pgs.site_rank), "job iteration": f"{pos.agreed_iteration}/{t.train_iters}"}
        tail = {} if self.last_meeting is None else \
            {"site steps at last meeting": "/".join(map(str, self.last_meeting.site_iterations))}
        return IntervalLine(samples=pos.site_consumed_samples - acc.site_consumed_before, means=means,
                            consumed=pos.site_consumed_samples, of_iters=self.site_step_cap,
                            ranks=dims.world_size // dims.sites, lead=lead, tail=tail)
