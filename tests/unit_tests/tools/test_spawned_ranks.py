"""Ctrl-C on a benchmark tool while its ranks train: one line, exit 130, no trace, no rank
left behind (tools/benchmarks/spawned_ranks.py; the ranks keep the SIGINT their parent
ignores for them, megatron_lsgd/training/signals.py)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.unit_tests.checkpointing.launch import kill
from tools.benchmarks.process_tree import alive, descendants, sigkill

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _as_in_a_terminal() -> None:
    """Its own process group, SIGINT handled (a suite started in the background by a script
    passes SIGINT on ignored)."""
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_ctrl_c_stops_every_rank_with_one_line(tmp_path):
    log = tmp_path / "log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tools", "benchmarks", "quality", "lsgd_quality.py"), "--runs", "diloco",
             "--train-iters", "100000", "--num-layers", "1", "--hidden-size", "32", "--seq-length", "16",
             "--global-batch-size", "8", "--interval", "5", "--out-dir", str(tmp_path / "out")],
            stdout=out, stderr=subprocess.STDOUT, text=True, preexec_fn=_as_in_a_terminal,
            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline = time.monotonic() + 300
        while "iteration       20/" not in log.read_text():  # the ranks are training, collectives under way
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        ranks = descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)  # the whole group, as Ctrl-C in a terminal
        assert proc.wait(timeout=60) == 130, log.read_text()[-3000:]
    finally:
        kill(proc)  # whatever failed above, no rank trains on after the test
    after = [line for line in log.read_text().splitlines() if not line.startswith((" [", ">", "note: joining"))]
    assert after == ["interrupted: every rank stopped; no table written"], "\n".join(after)[-3000:]
    deadline = time.monotonic() + 10  # (multiprocessing's resource tracker leaves after its parent)
    while [pid for pid in ranks if alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in ranks if alive(pid)]
    sigkill(left)  # (not left running by a failed test)
    assert not left, "ranks left running after the interrupt"


def _finishes_then_aborts_at_exit(rank: int, out_dir: str) -> None:
    """A rank that writes its result and returns, and whose interpreter teardown then aborts
    (as gloo's teardown once did: SIGABRT after a finished run)."""
    import atexit

    with open(os.path.join(out_dir, f"{rank}.txt"), "w") as f:
        f.write("done")
    atexit.register(os.abort)


@pytest.mark.slow
def test_a_rank_that_finished_is_not_failed_by_its_teardown(tmp_path):
    from tools.benchmarks.spawned_ranks import run_ranks

    run_ranks(_finishes_then_aborts_at_exit, (str(tmp_path),), 2)  # raises if a rank's exit code is not 0
    assert sorted(os.listdir(tmp_path)) == ["0.txt", "1.txt"]
