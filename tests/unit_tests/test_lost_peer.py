"""A site that dies mid-run: the surviving site ends with one `error:` line naming its rank
and site, exit code 2, no Python traceback, and does not hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.unit_tests.checkpointing.launch import ROOT, TINY, read
from tests.unit_tests.harness import free_port


def _site(rank: int, port: int, log: str, extra):
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return subprocess.Popen([sys.executable, "pretrain_gpt.py"] + TINY + ["--num-sites", "2", "--train-iters", "100000"]
                            + extra, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", [["--lsgd-algorithm", "sync"],
                                       ["--lsgd-algorithm", "dilocox", "--lsgd-interval", "2"],
                                       # its cross-site collectives run on a worker thread
                                       ["--lsgd-algorithm", "acco", "--global-batch-size", "8"]])
def test_the_surviving_site_says_what_happened(tmp_path, algorithm):
    port = free_port()
    logs = [str(tmp_path / f"site{i}.log") for i in range(2)]
    survivor, victim = (_site(i, port, logs[i], algorithm) for i in range(2))
    try:
        deadline = time.monotonic() + 120
        while "iteration        5/" not in read(logs[1]):  # the last rank logs
            assert victim.poll() is None and time.monotonic() < deadline, read(logs[1])[-2000:]
            time.sleep(0.05)
        victim.send_signal(signal.SIGKILL)
        code = survivor.wait(timeout=60)
    finally:
        for p in (survivor, victim):
            if p.poll() is None:
                p.kill()
    text = read(logs[0])
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
    port = free_port()
    logs = [str(tmp_path / f"rank{i}.log") for i in range(2)]
    procs = [_site(i, port, logs[i], ["--json-log", "/dev/full"]) for i in range(2)]
    try:
        codes = [p.wait(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    text = read(logs[0]) + read(logs[1])
    assert codes == [2, 2], text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith(("error:", "stopped:"))]
    assert errors == ["error: cannot write --json-log /dev/full: [Errno 28] No space left on device (the disk is full "
                      "or a size limit was reached: free space or write elsewhere)"], text[-3000:]
