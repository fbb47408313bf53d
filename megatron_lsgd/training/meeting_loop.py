"""The non-lockstep training loop: sites take different numbers of steps and agree only where
they meet (every synchronizer with `lockstep = False`: a-edit).

- The job's length is a budget of samples (--train-samples / --train-tokens, or
  --train-iters global batches); each site's data stream is sized for the fastest site (one
  site could consume the whole budget), and a site that has taken all of it without the
  sites agreeing to stop is an error.
- The sites agree only at *meetings* the synchronizer holds in its own collectives (after
  every step, termination.py asks it `agree_to_stop`, and the loop reads `meeting()`): the
  loop evaluates, saves and stops only there. The point is named by the job's progress
  (samples of all sites // global batch), which is also the checkpoint's iteration;
  --eval-interval, --save-interval and --exit-interval act at the first meeting at or past
  a multiple of it. Every site keeps its own iteration, LR schedule and sample position in
  the checkpoint.
- Every site's last rank logs its own line (its own steps, loss and tokens, tagged with the
  site, the job's agreed progress and every site's steps at the last meeting), with no
  cross-site collective.

The steps, evaluation, saving and log-line writing are the Trainer's (training.py), shared
with the lockstep loop (lockstep_loop.py); this module holds what meetings decide."""

from __future__ import annotations

from typing import Dict, Optional

from megatron_lsgd.core.lsgd.protocol import Meeting, Stop
from megatron_lsgd.training.logging_utils import print_rank
from megatron_lsgd.training.run_state import Interval, IntervalLine, Run


def crossed(before: int, now: int, interval: Optional[int]) -> bool:
    """A multiple of `interval` lies in (before, now]."""
    return bool(interval) and now // interval > before // interval


class MeetingLoop:
    def __init__(self, trainer):
        self.trainer = trainer
        cfg, site = trainer.config, trainer.pgs.site_rank
        t = cfg.training
        ranks_per_site = cfg.dims.world_size // cfg.dims.sites
        self.line_rank = (site + 1) * ranks_per_site - 1  # this site's last rank (last stage) logs its line
        budget = t.train_samples if t.train_samples is not None else t.train_iters * t.global_batch_size
        self.site_step_cap = budget // (t.global_batch_size // cfg.dims.sites)  # all of the job's budget
        self.tags: Dict[str, int] = {"site": site}  # every site's records carry it
        self.where = f" on site {site}"
        self.last_meeting: Optional[Meeting] = None

    @property
    def checkpoint_iteration(self) -> int:
        """A checkpoint is named by the job's progress at the last meeting, in global batches."""
        return self.trainer.agreed_iteration

    def run(self, run: Run) -> None:
        """Step; at a meeting take the job's agreed progress, and only there evaluate, save
        and stop."""
        tr = self.trainer
        t = tr.config.training
        while not tr.ended:  # a resumed run whose training had already ended takes no step
            if tr.step(run) is not None:  # training ended inside the step (no step taken): the final state is held
                return
            stop = tr.termination.after_step(tr.iteration, tr.site_consumed_samples)
            meeting = tr.synchronizer.meeting()
            before = tr.agreed_iteration
            if meeting is not None:  # agreed on every rank
                self._agree(meeting)
                if stop is None and crossed(before, tr.agreed_iteration, t.exit_interval):
                    stop = Stop(False, f"--exit-interval {t.exit_interval}")
            if tr.iteration % t.log_interval == 0 or stop is not None:
                tr.log_interval(run)
            eval_due = meeting is not None and crossed(before, tr.agreed_iteration, t.eval_interval)
            save_due = meeting is not None and crossed(before, tr.agreed_iteration, tr.config.checkpoint.save_interval)
            if tr.act_on(run, stop, eval_due, save_due):
                if stop.ends_training:
                    print_rank(f"training ends at iteration {tr.iteration} of site {tr.pgs.site_rank} "
                               f"({stop.reason})", tr.pgs.rank, self.line_rank)
                return
            if tr.iteration >= self.site_step_cap:
                raise RuntimeError(f"--lsgd-algorithm {tr.config.lsgd.algorithm}: site {tr.pgs.site_rank} took "
                                   f"{tr.iteration} steps, all its data, without the sites agreeing to stop")

    def _agree(self, meeting: Meeting) -> None:
        """The job's progress is the meeting's: every site's samples together."""
        tr = self.trainer
        self.last_meeting = meeting
        tr.consumed_samples = meeting.samples
        tr.agreed_iteration = meeting.samples // tr.config.training.global_batch_size
        if meeting.synced:  # not at a pause's extra meeting: a resumed run stays exact
            self._follow_job_schedule(meeting)

    def _follow_job_schedule(self, meeting: Meeting) -> None:
        """A site's LR schedule is the job's, not its own step count's. Its schedule spans
        the job's --train-iters global batches, so a fast site counting its own steps would
        finish the decay early and run its last steps at --min-lr; at every meeting that
        syncs its position becomes the job's agreed progress (between them it advances one
        global batch per own step, as if every site kept its pace)."""
        scheduler = self.trainer.scheduler
        scheduler.num_steps = meeting.samples if scheduler.by_samples \
            else meeting.samples // self.trainer.config.training.global_batch_size

    # ---- counting the job's samples ----------------------------------------------------------
    def count_job_samples(self, site_samples: int, same_on_every_site: bool) -> int:
        """The job's total is agreed at meetings only (_agree sets it); returns the step's
        global batch as if every site had computed as many."""
        return site_samples * self.trainer.config.dims.sites

    def settle_job_samples(self) -> None:
        """Nothing to settle: the job's total is the last meeting's."""

    # ---- the log line ------------------------------------------------------------------------
    def interval_line(self, acc: Interval) -> IntervalLine:
        """This site's own line: its samples, steps and losses, no cross-site collective (the
        sites are at different steps)."""
        tr = self.trainer
        means = {k: float((v / acc.iters).item()) for k, v in acc.sums.items()} if tr.pgs.is_last_stage else {}
        t = tr.config.training
        lead = {"site": str(tr.pgs.site_rank), "job iteration": f"{tr.agreed_iteration}/{t.train_iters}"}
        tail = {} if self.last_meeting is None else \
            {"site steps at last meeting": "/".join(map(str, self.last_meeting.site_iterations))}
        return IntervalLine(samples=tr.site_consumed_samples - acc.site_consumed_before, means=means,
                            consumed=tr.site_consumed_samples, of_iters=self.site_step_cap,
                            ranks=tr.config.dims.world_size // tr.config.dims.sites, lead=lead, tail=tail)
