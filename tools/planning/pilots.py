"""Time per step of each algorithm on a job, from the simulated clock running the real
synchronizers: the leaderboard's pilot (tools/benchmarks/leaderboard.py), shorter.

A pilot trains the leaderboard's stand-in GPT with the leaderboard's flags for the
algorithm (leaderboard_setup.cell_argv: the same recommended settings, the same data),
one rank per site, on the job's scenario file, whose bytes-scale (target parameters /
trained parameters) charges every cross-site byte as the target model's. Its pace
(simulated training seconds / steps) is the board's pilot pace when the steps cover whole
rounds, which is why a pilot runs a whole number of the algorithm's intervals. Nothing here
models time: what the clock (core/simulation.py) charges is the answer, so the planner and
the board cannot disagree, and a change to the clock's link or straggler model reaches both.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from megatron_lsgd.training.scenario import Scenario  # noqa: E402
from tools.benchmarks.leaderboard_setup import (LAYERS, MICRO_BATCH, TRAINED_PARAMS_GUESS, cell_argv,  # noqa: E402
                                                recommended, recommended_interval)


# Algorithms whose exchange comes once per interval (leaderboard_setup.recommended gives them
# H, or a-edit H steps' time); the others exchange every step.
ROUND_BASED = {"diloco", "dilocox", "streaming-diloco", "cocodc", "dreamddp", "edit", "a-edit"}


@dataclass
class Pace:
    """What one pilot measured, per step of the job (a step: one global batch)."""
    algorithm: str
    settings: List[str]             # the synchronizer's flags the pilot ran with
    steps: int
    seconds_per_step: float         # simulated
    exposed_seconds_per_step: float  # waiting for cross-site communication (the clock's)
    cross_site_bytes_per_step: float  # every site's sent + received, scaled to the target model
    stats: Dict


def pilot_steps(algorithm: str, scenario: Scenario, minimum: int) -> int:
    """Whole intervals of the algorithm's recommended H, at least `minimum` steps: a pace over
    part of a round would leave out (or count twice) a round's exchange."""
    h = recommended_interval(scenario) if algorithm in ROUND_BASED else 1
    return max(h, math.ceil(minimum / h) * h)


def run_pilot(algorithm: str, scenario_path: str, scenario: Scenario, steps: int, extra: Sequence[str] = ()) -> Pace:
    from tools.benchmarks.leaderboard import run_cell  # spawns the ranks (imported late: torch.multiprocessing)

    argv = cell_argv(scenario_path, algorithm, 1, steps, 0, scenario.sites, extra=extra)
    cell = run_cell(argv, scenario.sites)
    scale = scenario.bytes_scale_for(TRAINED_PARAMS_GUESS)
    comm = cell.get("comm") or {}
    # A step of the job is one global batch of its tokens. acco and dpu add micro-batches while
    # they wait (adaptive accumulation), so an update can hold several: count global batches
    # consumed, not updates (for every other algorithm the two are equal).
    batches = cell["samples"] / (MICRO_BATCH * scenario.sites) if cell.get("samples") else steps
    return Pace(algorithm=algorithm, settings=recommended(algorithm, scenario) + list(extra), steps=steps,
                seconds_per_step=cell["seconds"] / batches,
                exposed_seconds_per_step=comm.get("exposed_seconds", 0.0) / batches,
                cross_site_bytes_per_step=cell["traffic"]["bytes"] * scale / batches, stats=cell.get("stats") or {})


def run_pilots(algorithms: Sequence[str], scenario_path: str, scenario: Scenario, minimum_steps: int,
               progress=print) -> Dict[str, Optional[Pace]]:
    """One pilot per algorithm; a pilot that fails is reported and left out (None)."""
    import time

    out: Dict[str, Optional[Pace]] = {}
    for i, algorithm in enumerate(algorithms, 1):
        steps = pilot_steps(algorithm, scenario, minimum_steps)
        start = time.monotonic()
        progress(f"> pilot {i} of {len(algorithms)}: {algorithm}, {steps} steps on the simulated clock ...")
        try:
            out[algorithm] = run_pilot(algorithm, scenario_path, scenario, steps)
        except Exception as err:  # a rank's error is printed above; the other pilots go on
            progress(f"warning: the {algorithm} pilot failed ({err}); it is left out of the table")
            out[algorithm] = None
            continue
        progress(f"  {out[algorithm].seconds_per_step:.4g} simulated s per step "
                 f"({time.monotonic() - start:.1f} s real)")
    return out


__all__ = ["Pace", "pilot_steps", "run_pilot", "run_pilots", "LAYERS"]
