"""Run pretrain_gpt.py's jobs and read what they printed and saved: `run` to completion in
ranks forked from the test session's preloaded server, `start_forked`/`start_together` the
same without waiting (one job a test kills; the sites of an elastic job), `start` under
torchrun as a subprocess (its own process group, for a test of the launcher: signals to
torchrun, a site killed whole and restarted as --max-restarts would)."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.multiprocessing as mp

from tests.unit_tests.harness import free_port, join_as_rank, join_spawned, start_spawned
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
    session's preloaded server (harness.start_spawned), without torchrun's agent and a fresh
    interpreter per rank, which cost these tests most of their time; `start_forked` for a job a
    test kills. (The generous timeout is for a loaded machine.)"""
    job = Job(list(args), nproc, log_path, dict(env or {}))
    return finish_together(start_together([job]), [job], timeout)[0]


@dataclass(frozen=True)
class Job:
    """One job of `start_together`: its flags, ranks, log, environment, and the module whose
    main(argv) each rank runs (pretrain_gpt, or a test's wrapper of it)."""
    args: List[str]
    nproc: int
    log_path: str
    env: Dict[str, str] = field(default_factory=dict)
    entry: str = "pretrain_gpt"


class Ranks:
    """The forked ranks of `start_together` or `start_forked`, polled and killed like the
    Popen `start` returns (`poll`, `kill`, `wait_for`)."""

    def __init__(self, context):
        self.context = context
        self.processes = context.processes

    def poll(self) -> Optional[int]:
        """None while a rank runs; then the first non-zero exit code (a signal: negative), or 0."""
        codes = [p.exitcode for p in self.processes]
        if any(code is None for code in codes):
            return None
        return next((code for code in codes if code), 0)


def start_together(jobs: List[Job]) -> Ranks:
    """Start several jobs at once, each its own world (the sites of an elastic job), their
    ranks forked from the preloaded server like `run`'s (no torchrun agent, no fresh
    interpreter: a start takes a second, not ten); `finish_together` waits for them. One rank
    that fails stops them all there; a test may `kill` them."""
    table = []
    for job in jobs:
        open(job.log_path, "w").close()
        table.append((job, free_port()))
    return Ranks(start_spawned(_job_rank, (table,), nprocs=sum(job.nproc for job in jobs)))


def start_forked(args: List[str], nproc: int, log_path: str, env: Optional[Dict[str, str]] = None) -> Ranks:
    """One job like `start`'s, its ranks forked instead of under torchrun: for a test that
    kills the ranks (SIGKILL mid-save) and needs no launcher."""
    return start_together([Job(list(args), nproc, log_path, dict(env or {}))])


def finish_together(ranks: Ranks, jobs: List[Job], timeout: float = 600.0) -> List[str]:
    """Wait for `start_together`'s jobs to end; returns what each printed (a job that failed or
    ran past `timeout` fails the test with the end of every log)."""
    try:
        join_spawned(ranks.context, timeout)
        failure = None
    except (mp.ProcessExitedException, mp.ProcessRaisedException, TimeoutError) as err:
        failure = err
    texts = [read(job.log_path) for job in jobs]
    assert failure is None, f"run failed ({failure}):\n" + "\n".join(text[-3000:] for text in texts)
    return texts


def _job_rank(index: int, table: list) -> None:
    for job, port in table:
        if index < job.nproc:
            return _rank(index, job.nproc, port, job.args, job.log_path, job.env, job.entry)
        index -= job.nproc


def _rank(rank: int, world: int, port: int, args: List[str], log_path: str, env: Dict[str, str],
          entry: str = "pretrain_gpt") -> None:
    """One rank of `run`: pretrain_gpt.py's main (or `entry`'s) with the environment torchrun
    would give it, printing into the job's log (appended, like torchrun's workers sharing one stdout)."""
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    join_as_rank(rank, world, port, OMP_NUM_THREADS="1", **env)
    os.chdir(ROOT)
    from megatron_lsgd.training.initialize import shutdown_distributed

    importlib.import_module(entry).main(args)
    shutdown_distributed()


def kill(proc) -> None:
    """SIGKILL the launcher and every rank at once (or the forked `Ranks`); returns when all are
    gone (a run started next must not find the killed one still holding its directory,
    however loaded the machine is)."""
    if isinstance(proc, Ranks):
        for p in proc.processes:
            p.kill()
        for p in proc.processes:
            p.join(timeout=120)
        assert proc.poll() is not None, "killed ranks still alive after 120 s"
        return
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


# Measurements kept in state, named "...seconds..." (dilocox's last transfer time for its
# adaptive H, acco's last jobs' lengths for its adaptive counts, cocodc's step and sync times
# for its adaptive N) differ between any two runs on the wall clock, and in the last bits on a
# simulated one that resumed; everything else must match bit for bit.
def _measured(where: str) -> bool:
    return any("seconds" in part for part in where.split("/"))


def assert_same(a, b, where: str = "") -> None:
    """Bitwise equality of nested checkpoint contents (measured timings excepted)."""
    if _measured(where) and isinstance(a, float) and isinstance(b, float):
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
