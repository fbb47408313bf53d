"""pretrain_gpt.main with ACCO/DPU's worker held to one pace (env WORKER_PACE), so a test sees
what the log reads while the worker steps the scheduler: "slow" holds each job back
(the compute thread logs before the worker has compressed and stepped the schedule); "fast" lets the
compute thread log only once the job in flight has ended (after it stepped it)."""

from __future__ import annotations

import concurrent.futures
import os
import time

import pretrain_gpt
from megatron_lsgd.core.lsgd.algorithms.acco import OverlappedGradientSync


def _slow_worker() -> None:
    job = OverlappedGradientSync._job_fn

    def held_back(self, *args, **kwargs):
        time.sleep(0.3)  # before the job compresses, averages and steps
        return job(self, *args, **kwargs)

    OverlappedGradientSync._job_fn = held_back


def _fast_worker() -> None:
    train_step = OverlappedGradientSync.train_step

    def after_the_job(self, *args, **kwargs):
        result = train_step(self, *args, **kwargs)
        if self._job is not None:
            concurrent.futures.wait([self._job])
        return result

    OverlappedGradientSync.train_step = after_the_job


def main(argv):
    {"slow": _slow_worker, "fast": _fast_worker}[os.environ["WORKER_PACE"]]()
    return pretrain_gpt.main(argv)
