"""`python -m tools.bench SUBCOMMAND ARGS` runs the tool's own script with ARGS (tools/bench.py)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from tools import bench

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_every_subcommand_names_a_tool_and_passes_the_rest_of_the_line():
    for name, (module, _) in bench.SUBCOMMANDS.items():
        assert importlib.util.find_spec(module) is not None, name
    assert bench.resolve(["board", "--cached-only", "--seeds", "3"]) == (
        "tools.benchmarks.leaderboard", ["--cached-only", "--seeds", "3"])
    assert bench.resolve(["step", "mfu", "--preset", "smoke"]) == ("tools.benchmarks.mfu", ["--preset", "smoke"])
    with pytest.raises(ValueError, match="unknown subcommand 'step'"):
        bench.resolve(["step"])


def bench_run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the checkout as a user's shell has it
    return subprocess.run([sys.executable, "-m", "tools.bench", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_a_subcommand_is_its_tool_and_an_unknown_one_lists_them():
    board = bench_run("board", "--help")
    assert board.returncode == 0 and board.stdout.startswith("usage: leaderboard.py")
    plan = bench_run("plan", "--help")  # plan.py finds the checkout from a package import too
    assert plan.returncode == 0 and plan.stdout.startswith("usage: plan.py")
    wrong = bench_run("nope")
    assert wrong.returncode == 1 and "error: unknown subcommand 'nope'" in wrong.stderr
    assert all(name in wrong.stderr for name in bench.SUBCOMMANDS)
