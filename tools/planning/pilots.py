"""Time per step of each algorithm on a job, from the simulated clock running the real
synchronizers: the leaderboard's pilot (tools/benchmarks/board/leaderboard.py).

A pilot trains the leaderboard's stand-in GPT with the leaderboard's flags for the
algorithm (leaderboard_setup.cell_argv: the same recommended settings, the same data),
one rank per site, on the job's scenario file, whose bytes-scale (target parameters /
trained parameters) charges every cross-site byte as the target model's. Nothing here
models time: what the clock (core/simulation.py) charges is the answer, so the planner and
the board cannot disagree, and a change to the clock's link or straggler model reaches both.

Three things make the pilots cheap without changing what the clock charges:
- a round-based algorithm's pilot is the board's pilot, PILOT_STEPS steps (its pace then is
  the board's: a run of one round would carry its final, unhidden exchange on one round
  instead of three, 22-80% slower for the four that overlap it); an every-step algorithm's
  pilot is EVERY_STEP_PILOT steps (sync's pace is the same after 10; acco's and dpu's
  adaptive accumulation waits out its first, unmeasured jobs: +3.9% and +8.0% per global
  batch after 10 steps, +0.3% and +0.6% after 100, on 2x8gpu-1gbit-1b);
- the pilots train sequences of PILOT_SEQ tokens: the clock charges a micro-batch at the
  scenario's cost whatever its length, and with rotary positions the parameters (so the
  bytes and the fragments) do not depend on it, so only the real compute shrinks;
- every pilot runs in one set of spawned ranks, one after another (start-up, imports and
  the data index are paid once); when one stops the batch, the rest run again as a batch,
  and one that stops it twice is reported for itself alone and left out.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from megatron_lsgd.training.initialize import free_port  # noqa: E402
from megatron_lsgd.training.scenario import Scenario  # noqa: E402
from tools.benchmarks.board.leaderboard_setup import MICRO_BATCH, PILOT_STEPS, cell_argv  # noqa: E402
from tools.benchmarks.recipes import LAYERS, TRAINED_PARAMS_GUESS, recommended, recommended_interval  # noqa: E402


# The recommended flags that follow H: an algorithm with any exchanges once per interval (the
# others every step), and a grid point at another H sets them as its recipe does at that H.
INTERVAL_FLAGS = ("--lsgd-interval", "--lsgd-aedit-interval-seconds", "--lsgd-fragment-sync-delay")
EVERY_STEP_PILOT = 50
PILOT_SEQ = 8
# --grid: each round-based algorithm also at these multiples of the recommended H.
GRID_FACTORS = (0.5, 2.0)


@dataclass
class Pilot:
    """One pilot to run: an algorithm with the flags that follow its recommended ones."""
    algorithm: str
    extra: List[str] = field(default_factory=list)
    interval: Optional[int] = None  # H of a grid point (None: the recommended one)

    @property
    def label(self) -> str:
        return self.algorithm if self.interval is None else f"{self.algorithm} H={self.interval}"


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
    label: str = ""


def interval_flags(algorithm: str, scenario: Scenario, interval: Optional[int] = None) -> List[str]:
    """The flags (with their values) of the algorithm's recommended settings at H = `interval`
    (default: the recommended H) that follow H; none for an algorithm that exchanges every step."""
    flags = recommended(algorithm, scenario, interval)
    return [x for i, flag in enumerate(flags) if flag in INTERVAL_FLAGS for x in flags[i:i + 2]]


def pilot_steps(algorithm: str, scenario: Scenario, minimum: Optional[int] = None,
                interval: Optional[int] = None) -> int:
    """The board's pilot length for a round-based algorithm (whole intervals of a grid
    point's H), EVERY_STEP_PILOT steps for the others; `minimum` (--pilot-steps) instead asks
    for at least that many steps in whole intervals."""
    if not interval_flags(algorithm, scenario):
        return minimum or EVERY_STEP_PILOT
    h = interval or recommended_interval(scenario)
    if minimum is None:
        if interval is None:
            return PILOT_STEPS
        minimum = PILOT_STEPS
    return max(h, math.ceil(minimum / h) * h)


def grid(algorithms: Sequence[str], scenario: Scenario) -> List[Pilot]:
    """Each algorithm at its recommended settings, and each round-based one also at
    GRID_FACTORS x its H (whole fragments), with the flags that follow H as its recipe sets them
    there (the streaming family's tau, a-edit's interval of H steps' time)."""
    h = recommended_interval(scenario)
    out = []
    for algorithm in algorithms:
        out.append(Pilot(algorithm))
        if not interval_flags(algorithm, scenario):
            continue
        for factor in GRID_FACTORS:
            hh = max(LAYERS, -(-int(round(h * factor)) // LAYERS) * LAYERS)
            if hh != h:
                out.append(Pilot(algorithm, interval_flags(algorithm, scenario, hh), hh))
    return out


def merged(flags: Sequence[str], overrides: Sequence[str]) -> List[str]:
    """`flags` with each `--flag value` pair of `overrides` in place of its own (added when
    absent): the flags to paste, each once."""
    out = list(flags)
    for i in range(0, len(overrides), 2):
        flag, value = overrides[i], overrides[i + 1]
        if flag in out:
            out[out.index(flag) + 1] = value
        else:
            out += [flag, value]
    return out


def global_batches(cell: Dict, sites: int, steps: int) -> float:
    """A step of the job is one global batch of its tokens. acco and dpu add micro-batches while
    they wait (adaptive accumulation), so an update can hold several: count global batches
    consumed, not updates (for every other algorithm the two are equal)."""
    return cell["samples"] / (MICRO_BATCH * sites) if cell.get("samples") else steps


def pace_from_cell(pilot: Pilot, scenario: Scenario, steps: int, cell: Dict) -> Pace:
    scale = scenario.bytes_scale_for(TRAINED_PARAMS_GUESS)
    comm = cell.get("comm") or {}
    batches = global_batches(cell, scenario.sites, steps)
    return Pace(algorithm=pilot.algorithm, settings=merged(recommended(pilot.algorithm, scenario), pilot.extra),
                steps=steps, seconds_per_step=cell["seconds"] / batches,
                exposed_seconds_per_step=comm.get("exposed_seconds", 0.0) / batches,
                cross_site_bytes_per_step=cell["traffic"]["bytes"] * scale / batches, stats=cell.get("stats") or {},
                label=pilot.label)


def _argv(pilot: Pilot, scenario_path: str, scenario: Scenario, steps: int) -> List[str]:
    # the short sequence is the pilot's, not a setting: it stays out of Pace.settings
    return cell_argv(scenario_path, pilot.algorithm, 1, steps, 0, scenario.sites,
                     extra=list(pilot.extra) + ["--seq-length", str(PILOT_SEQ)])


def run_pilot(algorithm: str, scenario_path: str, scenario: Scenario, steps: int, extra: Sequence[str] = ()) -> Pace:
    """One pilot in ranks of its own."""
    from tools.benchmarks.board.leaderboard import run_cell  # spawns the ranks (imported late: torch.multiprocessing)

    pilot = Pilot(algorithm, list(extra))
    return pace_from_cell(pilot, scenario, steps, run_cell(_argv(pilot, scenario_path, scenario, steps),
                                                           scenario.sites))


def _pilots_worker(rank: int, world: int, runs: List, out_dir: str, announce: bool) -> None:
    """Every pilot in turn, in this rank's one process: each joins a world of its own (a port
    of its own) and leaves it before the next; the last rank announces each one's pace."""
    from tools.benchmarks.board.leaderboard import _worker

    for i, (label, port, argv) in enumerate(runs):
        start = time.monotonic()
        folder = os.path.join(out_dir, str(i))
        os.makedirs(folder, exist_ok=True)
        _worker(rank, world, port, argv, folder)
        if announce and rank == world - 1:
            record = json.load(open(os.path.join(folder, f"{rank}.json")))
            batches = global_batches(record, world, record["iterations"])
            print(f"  {label}: {record['seconds'] / batches:.4g} simulated s per step "
                  f"({time.monotonic() - start:.1f} s real)", file=sys.stderr, flush=True)


def _finished(folder: str, world: int) -> bool:
    return all(os.path.exists(os.path.join(folder, f"{r}.json")) for r in range(world))


@contextlib.contextmanager
def ranks_output_to(path: str):
    """The pilots' ranks print a whole training log each; it goes to a file (their errors
    still reach stderr), so the progress lines stay readable."""
    sys.stdout.flush()
    saved = os.dup(1)
    with open(path, "a") as log:
        os.dup2(log.fileno(), 1)
        try:
            yield
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)


def run_pilots(algorithms: Sequence[str], scenario_path: str, scenario: Scenario,
               minimum_steps: Optional[int] = None, progress=print,
               pilots: Optional[Sequence[Pilot]] = None) -> Dict[str, Optional[Pace]]:
    """One pilot per algorithm (or the given `pilots`, e.g. grid()'s), keyed by label. They run
    as one batch; when the batch stops at a pilot, the unfinished ones run again as a batch
    (fresh ports: a port taken meanwhile by another job is the usual cause), and a pilot that
    stops it twice is reported and left out (None)."""
    from tools.benchmarks.board.leaderboard import cell_of
    from tools.benchmarks.spawned_ranks import run_ranks

    pilots = list(pilots) if pilots is not None else [Pilot(a) for a in algorithms]
    world = scenario.sites
    steps = [pilot_steps(p.algorithm, scenario, minimum_steps, p.interval) for p in pilots]
    argvs = [_argv(p, scenario_path, scenario, n) for p, n in zip(pilots, steps)]
    announce = progress is not None
    say = progress or (lambda line: None)
    say(f"> {len(pilots)} pilots in one set of {world} ranks: "
        + ", ".join(f"{p.label} ({n} steps)" for p, n in zip(pilots, steps)))
    out: Dict[str, Optional[Pace]] = {}
    remaining, stopped_by = list(range(len(pilots))), Counter()
    with tempfile.TemporaryDirectory() as d:
        for attempt in itertools.count():
            if not remaining:
                break
            folder = os.path.join(d, str(attempt))
            try:
                run_ranks(_pilots_worker, (world, [(pilots[i].label, free_port(), argvs[i]) for i in remaining],
                                           folder, announce), world)
            except Exception as err:  # a rank's error is printed above
                say(f"warning: the pilots stopped ({err})")
            unfinished = []
            for k, i in enumerate(remaining):
                if _finished(os.path.join(folder, str(k)), world):
                    out[pilots[i].label] = pace_from_cell(pilots[i], scenario, steps[i],
                                                          cell_of(os.path.join(folder, str(k)), world))
                else:
                    unfinished.append(i)
            if unfinished:
                first = unfinished[0]
                stopped_by[first] += 1
                if stopped_by[first] == 2:
                    say(f"warning: the {pilots[first].label} pilot failed twice; it is left out of the table")
                    out[pilots[first].label] = None
                    unfinished = unfinished[1:]
                if unfinished:
                    say(f"> again from {pilots[unfinished[0]].label}: {len(unfinished)} pilots ...")
            remaining = unfinished
    return out


__all__ = ["Pace", "Pilot", "grid", "pilot_steps", "ranks_output_to", "run_pilot", "run_pilots", "LAYERS", "PILOT_SEQ"]
