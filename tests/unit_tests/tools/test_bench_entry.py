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
        "tools.benchmarks.board.leaderboard", ["--cached-only", "--seeds", "3"])
    assert bench.resolve(["step", "mfu", "--preset", "smoke"]) == ("tools.benchmarks.step.mfu", ["--preset", "smoke"])
    # a family's second word picks its tool; without one the first word is the family's main tool, if it has one
    assert bench.resolve(["wan", "report", "runs/wan"]) == ("tools.benchmarks.wan.wan_report", ["runs/wan"])
    assert bench.resolve(["wan", "--algorithms", "sync"]) == ("tools.benchmarks.wan.wan_bench",
                                                              ["--algorithms", "sync"])
    with pytest.raises(ValueError, match="unknown subcommand 'step'"):
        bench.resolve(["step"])
    with pytest.raises(ValueError, match="unknown subcommand 'parts nope'"):
        bench.resolve(["parts", "nope"])


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


# scripts a user does not run: started by another tool (chaos.py starts its toy sites)
NOT_SUBCOMMANDS = {"tools.benchmarks.elastic.ft_site"}


def test_the_benchmarks_top_level_holds_only_the_kit_and_every_script_has_a_subcommand():
    """Issue 51: tools/benchmarks/ holds one package per family and the kit they share; every
    script of a family (a module with a `__main__` block) is run through a subcommand."""
    top = os.path.join(ROOT, "tools", "benchmarks")
    scripts = set()
    for folder, _, files in os.walk(top):
        for name in files:
            if not name.endswith(".py"):
                continue
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                if 'if __name__ == "__main__"' not in f.read():
                    continue
            assert folder != top, f"tools/benchmarks/{name} is a script outside a family package"
            scripts.add(os.path.relpath(os.path.join(folder, name[:-3]), ROOT).replace(os.sep, "."))
    assert scripts, "no scripts found: the walk is wrong"
    assert scripts - NOT_SUBCOMMANDS == {module for module, _ in bench.SUBCOMMANDS.values()} - {"tools.plan"}
