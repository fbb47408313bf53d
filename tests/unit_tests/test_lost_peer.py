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
