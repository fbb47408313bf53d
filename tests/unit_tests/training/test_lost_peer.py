"""A site that dies mid-run: the surviving site ends with one `error:` line naming its rank
and site, exit code 2, no Python traceback, and does not hang."""

from __future__ import annotations

import os
import time

import pytest

from tests.unit_tests.checkpointing.launch import TINY, kill, read, start_forked


def _job(log: str, extra):
    """Two ranks, one site each, forked from the preloaded server (no launcher: nothing but the
    lost peer stops the survivor), printing into one log."""
    return start_forked(TINY + ["--num-sites", "2", "--train-iters", "100000"] + extra, 2, log)


def _exit_code(process, timeout: float):
    process.join(timeout=timeout)
    return process.exitcode


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", [["--lsgd-algorithm", "sync"],
                                       ["--lsgd-algorithm", "dilocox", "--lsgd-interval", "2"],
                                       # its cross-site collectives run on a worker thread
                                       ["--lsgd-algorithm", "acco", "--global-batch-size", "8"]])
def test_the_surviving_site_says_what_happened(tmp_path, algorithm):
    log = str(tmp_path / "job.log")
    ranks = _job(log, algorithm)
    survivor, victim = ranks.processes
    try:
        deadline = time.monotonic() + 120
        while "iteration        5/" not in read(log):  # the last rank logs
            assert victim.exitcode is None and time.monotonic() < deadline, read(log)[-2000:]
            time.sleep(0.05)
        victim.kill()
        code = _exit_code(survivor, 60)
    finally:
        kill(ranks)
    text = read(log)
    assert code == 2, text[-2000:]
    assert "error: rank 0 (site 0)" in text and "stopped" in text
    assert "Traceback" not in text


@pytest.mark.slow
def test_one_error_line_per_job_from_the_rank_that_knows_the_cause(tmp_path):
    """The logging rank (site 1) cannot write --json-log (a full device); rank 0 loses its
    peer in the next collective and stays silent: the job prints one `error:` line, the
    cause. No launcher here, so nothing else stops rank 0."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    log = str(tmp_path / "job.log")
    ranks = _job(log, ["--json-log", "/dev/full"])
    try:
        codes = [_exit_code(p, 180) for p in ranks.processes]
    finally:
        kill(ranks)
    text = read(log)
    assert codes == [2, 2], text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith(("error:", "stopped:"))]
    assert errors == ["error: cannot write --json-log /dev/full: [Errno 28] No space left on device (the disk is full "
                      "or a size limit was reached: free space or write elsewhere)"], text[-3000:]


def test_a_restarted_attempt_reports_its_own_error(monkeypatch):
    """torchrun --max-restarts keeps its store across attempts (seen on an H200: every
    restart of a failing site exited 2 without a word): the first failing rank of each
    attempt speaks, the others of that attempt stay silent."""
    import torch.distributed as dist

    from megatron_lsgd.training import guard

    store = dist.HashStore()  # one store for every attempt, as torchrun's agent keeps it
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
    said = []
    for attempt in ("0", "1", "2"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        said.append([guard.first_to_report(), guard.first_to_report()])
    assert said == [[True, False]] * 3
