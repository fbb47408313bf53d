#!/usr/bin/env python
"""The planner's pace against the leaderboard's pilots, per algorithm, on a board scenario.

    python tools/planning/board_check.py --scenario 2x8gpu-1gbit-1b [--pilot-steps 300]

For each algorithm with a pilot cell in results/leaderboard/cells (sync: its seed-1 cell), it runs
the planner's pilot (tools/planning/pilots.py) on the same scenario file and prints both paces
and their ratio. The pilots use the same argv builder, synchronizer and clock as the board's;
with the planner's default pilot lengths (tools/planning/pilots.py) every ratio is within 2%
(docs/planning.md, "Agreement"). Paces are per global batch of the job (acco's and dpu's
updates hold several).
"""

from __future__ import annotations

import glob
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_lsgd import cli  # noqa: E402
from megatron_lsgd.training.scenario import load_scenario  # noqa: E402
from tools.benchmarks.board.leaderboard import CELLS_DIR  # noqa: E402
from tools.benchmarks.board.leaderboard_setup import SCENARIO_DIR  # noqa: E402
from tools.benchmarks.recipes import ALGORITHMS  # noqa: E402
from tools.planning.pilots import global_batches, ranks_output_to, run_pilots  # noqa: E402


def board_pace(name: str, algorithm: str, sites: int):
    """The board's pilot pace per global batch, as the planner's (acco/dpu's updates hold several)."""
    label = "sync" if algorithm == "sync" else f"{algorithm}_pilot"
    found = sorted(glob.glob(os.path.join(CELLS_DIR, f"{name}__{label}__seed1__*.json")))
    if not found:
        return None
    cell = json.load(open(found[0]))
    return cell["seconds"] / global_batches(cell, sites, cell["steps"])


def main() -> None:
    p = cli.ArgumentParser(description=__doc__, formatter_class=cli.HelpFormatter)
    p.add_argument("--scenario", required=True, help="a name under tools/benchmarks/scenarios")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS))
    p.add_argument("--pilot-steps", type=int, default=None,
                   help="default: the planner's (the board's pilot length for round-based algorithms)")
    a = p.parse_args()
    with cli.user_errors():
        path = os.path.join(SCENARIO_DIR, f"{a.scenario}.toml")
        scenario = load_scenario(path)
        algorithms = [x for x in a.algorithms.split(",") if board_pace(a.scenario, x, scenario.sites) is not None]
        log = os.path.join(tempfile.gettempdir(), f"board-check-{os.getpid()}.log")
        print(f"> the pilots' ranks log to {log}", file=sys.stderr)
        with ranks_output_to(log):
            paces = run_pilots(algorithms, path, scenario, a.pilot_steps,
                               progress=lambda line: print(line, file=sys.stderr, flush=True))
        print("| algorithm | planner pilot steps | planner s/step | board s/step (its pilot) | ratio |")
        print("|---|---|---|---|---|")
        for algorithm, pace in paces.items():
            if pace is None:
                continue
            board = board_pace(a.scenario, algorithm, scenario.sites)
            print(f"| {algorithm} | {pace.steps} | {pace.seconds_per_step:.5g} | {board:.5g} | "
                  f"{pace.seconds_per_step / board:.4f} |")


if __name__ == "__main__":
    main()
