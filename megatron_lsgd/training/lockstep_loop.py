"""The lockstep training loop: every site takes the same steps (every synchronizer with
`lockstep = True`: sync, diloco, dilocox, streaming-diloco, cocodc, dreamddp, dpu, acco, edit).

This is Megatron's loop. Every rank holds the same iteration count, so the loop logs,
evaluates, saves and stops at iteration counts (--log-interval, --eval-interval,
--save-interval; termination.py decides the stop, one step late for the clock), a
checkpoint is named by that count, and one rank (the last stage of the last site) prints
the job's line, with losses averaged over sites.

The steps, evaluation, saving and log-line writing are the Trainer's (training.py), shared
with the non-lockstep loop (meeting_loop.py); this module holds what lockstep decides."""

from __future__ import annotations

from typing import Dict, Optional

import torch

from megatron_lsgd.training.run_state import Interval, IntervalLine, Run


class LockstepLoop:
    def __init__(self, trainer):
        self.trainer = trainer
        self.line_rank = trainer.log_rank  # prints the job's training lines
        self.site_step_cap = trainer.config.training.train_iters  # the most steps a site takes
        self.tags: Dict[str, int] = {}  # the job's records carry no site
        self.where = ""  # the done line speaks for the job
        self._job_samples_stale = False  # sites counted differently since consumed_samples was summed

    @property
    def checkpoint_iteration(self) -> int:
        """A checkpoint is named by the step count, the same on every site."""
        return self.trainer.iteration

    def run(self, run: Run) -> None:
        """Step, log, let termination decide, evaluate and save by iteration."""
        tr = self.trainer
        t = tr.config.training
        while tr.iteration < t.train_iters:
            if tr.step(run) is not None:  # training ended inside the step (no step taken): the final state is held
                return
            if tr.iteration % t.log_interval == 0 or tr.iteration == t.train_iters:
                tr.log_interval(run)
            stop = tr.termination.after_step(tr.iteration, tr.site_consumed_samples)
            eval_due = tr.iteration % t.eval_interval == 0
            save_due = bool(tr.config.checkpoint.save_interval) and \
                tr.iteration % tr.config.checkpoint.save_interval == 0
            if tr.act_on(run, stop, eval_due, save_due):
                return

    # ---- counting the job's samples ----------------------------------------------------------
    def count_job_samples(self, site_samples: int, same_on_every_site: bool) -> Optional[int]:
        """The job's total advances by this site's samples times the number of sites when
        every site computed as many; otherwise it becomes the sum of every site's own
        position, taken (settle_job_samples) where the loop logs or saves. Returns the
        step's global batch when known (None: sites differed)."""
        tr = self.trainer
        job = site_samples * tr.config.dims.dp // tr.pgs.dp_intra_size  # S x site_samples when sites are equal
        if same_on_every_site and not self._job_samples_stale:
            tr.consumed_samples += job
            return job
        self._job_samples_stale = True
        return None

    def settle_job_samples(self) -> None:
        """consumed_samples = the sum over sites of each site's own consumed samples (exact);
        a few bytes across sites, only after steps whose counts differed (collective)."""
        if not self._job_samples_stale:
            return
        tr = self.trainer
        total = torch.tensor([tr.site_consumed_samples], dtype=torch.int64, device=tr.device)
        tr.membership.sum_over_sites(total)
        tr.consumed_samples = int(total.item())
        self._job_samples_stale = False

    # ---- the log line ------------------------------------------------------------------------
    def interval_line(self, acc: Interval) -> IntervalLine:
        """The job's line: its samples and losses averaged over sites (collectives, at log
        intervals only)."""
        tr = self.trainer
        self.settle_job_samples()
        means = tr.mean_across_sites({k: v / acc.iters for k, v in acc.sums.items()}) \
            if tr.pgs.is_last_stage else {}
        return IntervalLine(samples=tr.consumed_samples - acc.consumed_before, means=means,
                            consumed=tr.consumed_samples, of_iters=tr.config.training.train_iters,
                            ranks=tr.config.dims.world_size)
