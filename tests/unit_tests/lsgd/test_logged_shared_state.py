"""Values logged from state another thread changes are read under the owner's
synchronisation: ACCO/DPU's worker steps the LR schedule while the compute thread goes on,
so reading the scheduler when the log line is printed gave the LR before or after the
worker's step, as the threads happened to run; the compressor's error statistic likewise.
Both are logged as of the last job the compute thread waited for: the same whether the
worker is held back or has finished."""

from __future__ import annotations

import re

import pytest

from tests.unit_tests.checkpointing.launch import TINY, Job, finish_together, start_together

def _run(job: Job) -> str:
    return finish_together(start_together([job]), [job])[0]


LR = re.compile(r"iteration\s+(\d+)/.*?learning rate: ([0-9.E+-]+)")
COMPRESSION = re.compile(r"iteration\s+(\d+)/.*?comp err norm: ([0-9.e+-]+)")


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["acco", "dpu"])
def test_logged_lr_does_not_depend_on_the_workers_pace(tmp_path, algorithm):
    args = TINY + ["--num-sites", "2", "--lsgd-algorithm", algorithm, "--global-batch-size", "8",
                   "--train-iters", "4", "--lsgd-accumulation", "fixed", "--lsgd-compression", "int8"]
    slow, fast = [_run(Job(args, 2, str(tmp_path / f"{pace}.log"), {"WORKER_PACE": pace},
                           "tests.unit_tests.lsgd.worker_pace")) for pace in ("slow", "fast")]
    lrs = [dict(LR.findall(text)) for text in (slow, fast)]
    assert len(lrs[0]) == 4 and len(set(lrs[0].values())) > 1, slow[-2000:]  # the warm-up moves the LR
    assert lrs[0] == lrs[1]
    errors = [dict(COMPRESSION.findall(text)) for text in (slow, fast)]
    assert len(errors[0]) >= 3 and len(set(errors[0].values())) > 1, slow[-2000:]
    assert errors[0] == errors[1]
