"""The lockstep training loop: every site takes the same steps (every synchronizer with
`lockstep = True`: sync, diloco, dilocox, streaming-diloco, cocodc, dreamddp, dpu, acco, edit).

This is Megatron's loop. Every rank holds the same iteration count, so the loop logs,
evaluates, saves and stops at iteration counts (--log-interval, --eval-interval,
--save-interval; its stop rule, termination.StepCountTermination, decides the stop, one
step late for the clock), a
checkpoint is named by that count, and one rank (the last stage of the last site) prints
the job's line, with losses averaged over sites.

The steps, evaluation, saving and log-line writing are the Trainer's (training.py), shared
with the non-lockstep loop (meeting_loop.py); this module holds what lockstep decides."""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from megatron_lsgd.training.logging_utils import mean_across_sites
from megatron_lsgd.training.run_state import Interval, IntervalLine, Position, Run
from megatron_lsgd.training.termination import StepCountTermination


class LockstepLoop:
    """Its collaborators are explicit: the run's config and process groups, the Position it
    advances, the membership (its few cross-site numbers go through it), and the clock and
    signals its stop rule reads; the Trainer's shared parts (a step, a log line, acting on
    decisions) are handed to `run`."""

    # Training ends at a step count: a run resumed from an ended checkpoint with a larger
    # --train-iters trains on, so a checkpoint's `ended` is not restored.
    resumes_ended = False

    def __init__(self, config, pgs, position: Position, membership, device: torch.device, line_rank: int,
                 clock, signals=None):
        self.config, self.pgs, self.position = config, pgs, position
        self.membership, self.device = membership, device
        self.termination = StepCountTermination(config.training, clock, signals)  # collective (its vote's group)
        self.line_rank = line_rank  # prints the job's training lines
        self.site_step_cap = config.training.train_iters  # the most steps a site takes
        self.tags: Dict[str, int] = {}  # the job's records carry no site
        self.where = ""  # the done line speaks for the job
        self._job_samples_stale = False  # sites counted differently since consumed_samples was summed

    @property
    def checkpoint_iteration(self) -> int:
        """A checkpoint is named by the step count, the same on every site."""
        return self.position.iteration

    def after_heal(self) -> None:
        """An elastic site took a live peer's position (elastic.py): every site takes the same
        steps on streams of the same pace, so the peer's is this site's and the job's count
        is the step count."""
        self.position.agreed_iteration = self.position.iteration

    def run(self, run: Run, step: Callable, log: Callable, act: Callable) -> None:
        """Step, log, let termination decide, evaluate and save by iteration (`step`, `log`
        and `act` are the Trainer's step, log_interval and act_on)."""
        pos, t = self.position, self.config.training
        save_interval = self.config.checkpoint.save_interval
        while pos.iteration < t.train_iters:
            taken = step(run)
            if taken.ended is not None:  # training ended inside the step (no step taken): the final state is held
                return
            run.acc.gbs = self.count_job_samples(taken.site_samples, taken.same_on_every_site)
            if pos.iteration % t.log_interval == 0 or pos.iteration == t.train_iters:
                log(run)
            stop = self.termination.after_step(pos.iteration, pos.site_consumed_samples)
            eval_due = pos.iteration % t.eval_interval == 0
            save_due = bool(save_interval) and pos.iteration % save_interval == 0
            if act(run, stop, eval_due, save_due):
                return

    # ---- counting the job's samples ----------------------------------------------------------
    def count_job_samples(self, site_samples: int, same_on_every_site: bool) -> Optional[int]:
        """The job's total advances by this site's samples times the number of sites when
        every site computed as many; otherwise it becomes the sum of every site's own
        position, taken (settle_job_samples) where the loop logs or saves. Returns the
        step's global batch when known (None: sites differed)."""
        job = site_samples * self.config.dims.dp // self.pgs.dp_intra_size  # S x site_samples when sites are equal
        if same_on_every_site and not self._job_samples_stale:
            self.position.consumed_samples += job
            return job
        self._job_samples_stale = True
        return None

    def settle_job_samples(self) -> None:
        """consumed_samples = the sum over sites of each site's own consumed samples (exact);
        a few bytes across sites, only after steps whose counts differed (collective)."""
        if not self._job_samples_stale:
            return
        total = torch.tensor([self.position.site_consumed_samples], dtype=torch.int64, device=self.device)
        self.membership.sum_over_sites(total)
        self.position.consumed_samples = int(total.item())
        self._job_samples_stale = False

    # ---- the log line ------------------------------------------------------------------------
    def interval_line(self, acc: Interval) -> IntervalLine:
        """The job's line: its samples and losses averaged over sites (collectives, at log
        intervals only)."""
        self.settle_job_samples()
        consumed, dims = self.position.consumed_samples, self.config.dims
        means = mean_across_sites({k: v / acc.iters for k, v in acc.sums.items()}, self.membership, dims.sites) \
            if self.pgs.is_last_stage else {}
        return IntervalLine(samples=consumed - acc.consumed_before, means=means, consumed=consumed,
                            of_iters=self.config.training.train_iters, ranks=dims.world_size)
