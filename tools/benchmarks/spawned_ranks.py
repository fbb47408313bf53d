"""The ranks of one training run as spawned processes of the tool that runs it
(leaderboard.py's cells, lsgd_quality.py's and quality_frontier.py's runs), stopped quietly.

Ctrl-C reaches every process of the terminal's group. Left to themselves, the ranks would stop
one by one, and each still inside a collective would print the C++ trace of its peers' closed
connections. Here the ranks ignore SIGINT and the parent, on Ctrl-C or SIGTERM, kills them all
at once and raises KeyboardInterrupt, for the tool to say what it kept and how to resume."""

from __future__ import annotations

import signal
import sys
from typing import Callable, Sequence

import torch.multiprocessing as mp

from megatron_lsgd.training.initialize import exit_finished_run
from tools.benchmarks.tool_input import tool_errors


def _rank(rank: int, worker: Callable, *args) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the ranks, all at once
    worker(rank, *args)
    # The rank's work is done and written (a worker writes its result before it returns); the
    # interpreter's teardown after gloo process groups can abort and would fail a complete run.
    exit_finished_run()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run_ranks(worker: Callable, args: Sequence, world: int) -> None:
    """worker(rank, *args) in `world` spawned processes, until all return; a rank's exception
    is raised here (torch's ProcessRaisedException) after the others are stopped. On Ctrl-C
    or SIGTERM, every rank is killed before KeyboardInterrupt propagates."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    context = mp.spawn(_rank, args=(worker, *args), nprocs=world, join=False)
    try:
        while not context.join():
            pass
    except KeyboardInterrupt:
        for process in context.processes:
            if process.is_alive():
                process.kill()
        for process in context.processes:
            process.join()
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_tool(main: Callable[[], None], kept: str) -> None:
    """A tool's entry point: main(), and on Ctrl-C or SIGTERM one line saying what is `kept`, exit 130."""
    try:
        with tool_errors():
            main()
    except KeyboardInterrupt:
        print(f"interrupted: every rank stopped; {kept}", file=sys.stderr)
        sys.exit(130)
