"""Run pretrain_gpt.py's jobs and read what they printed and saved: `run` to completion in
ranks forked from the test session's preloaded server, `start` under torchrun as a
subprocess (its own process group, so a test can signal or SIGKILL the whole job)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.multiprocessing as mp

from tests.unit_tests.harness import free_port, join_as_rank, spawn
from tools.benchmarks.process_tree import kill_tree

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
LOSS_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.E+-]+) \|")

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--lr", "2e-3", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine",
        "--min-lr", "1e-4", "--mock-data", "--vocab-size", "250", "--make-vocab-size-divisible-by", "32",
        "--log-interval", "1", "--eval-iters", "0", "--seed", "7", "--distributed-backend", "gloo"]


def start(args: List[str], nproc: int, log_path: str, env: Optional[Dict[str, str]] = None,
          script: str = "pretrain_gpt.py") -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), script] + args
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **(env or {}))
    log = open(log_path, "w")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                            start_new_session=True)


def run(args: List[str], nproc: int, log_path: str, timeout: float = 600.0,
        env: Optional[Dict[str, str]] = None) -> str:
    """Run to completion and return what the ranks printed. The ranks fork from the test
    session's preloaded server (harness.spawn), without torchrun's agent and a fresh
    interpreter per rank, which cost these tests most of their time; use `start` for a job a
    test signals or kills. (The generous timeout is for a loaded machine.)"""
    open(log_path, "w").close()
    try:
        spawn(_rank, (nproc, free_port(), list(args), log_path, env or {}), nprocs=nproc, timeout=timeout)
        failure = None
    except (mp.ProcessExitedException, mp.ProcessRaisedException, TimeoutError) as err:
        failure = err
    text = read(log_path)
    assert failure is None, f"run failed ({failure}):\n{text[-3000:]}"
    return text


def _rank(rank: int, world: int, port: int, args: List[str], log_path: str, env: Dict[str, str]) -> None:
    """One rank of `run`: pretrain_gpt.py's main with the environment torchrun would give it,
    printing into the job's log (appended, like torchrun's workers sharing one stdout)."""
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    join_as_rank(rank, world, port, OMP_NUM_THREADS="1", **env)
    os.chdir(ROOT)
    import pretrain_gpt
    from megatron_lsgd.training.initialize import shutdown_distributed

    pretrain_gpt.main(args)
    shutdown_distributed()


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every rank at once; returns when all are gone (a run started
    next must not find the killed one still holding its directory, however loaded the machine is)."""
    assert kill_tree(proc, timeout_s=120), "killed processes still alive after 120 s"


def wait_for(predicate, proc: subprocess.Popen, log_path: str, timeout: float = 300.0) -> None:
    """Poll until `predicate` holds; the job ending first, or `timeout` passing, fails the test
    (a tiny job's first steps take seconds on an idle machine and minutes at load average 40)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"job ended before the condition held:\n{read(log_path)[-3000:]}")
        if time.monotonic() > deadline:
            kill(proc)
            raise AssertionError(f"timed out:\n{read(log_path)[-3000:]}")
        time.sleep(0.02)


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def losses(text: str) -> Dict[int, str]:
    """iteration -> printed lm loss (the exact string)."""
    return {int(it): loss for it, loss in LOSS_LINE.findall(text)}


def load_tree(iter_dir: str) -> Dict[str, object]:
    """Every .pt file under an iteration directory, loaded safely."""
    out = {}
    for dirpath, _dirs, files in os.walk(iter_dir):
        for name in files:
            if name.endswith(".pt"):
                path = os.path.join(dirpath, name)
                out[os.path.relpath(path, iter_dir)] = torch.load(path, weights_only=True)
    return out


# Wall-clock measurements kept in state (dilocox's last transfer time, for its adaptive-H
# rule) differ between any two runs; everything else must match bit for bit.
MEASURED_TIMINGS = {"comm_seconds"}


def assert_same(a, b, where: str = "") -> None:
    """Bitwise equality of nested checkpoint contents (measured timings excepted)."""
    if where.rsplit("/", 1)[-1] in MEASURED_TIMINGS:
        assert isinstance(a, float) and isinstance(b, float), f"{where}: expected measured seconds"
        return
    assert type(a) is type(b), f"{where}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"
