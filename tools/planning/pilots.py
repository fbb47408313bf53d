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
- the pilots train sequences of PILOT_SEQ tokens with AdamW's fused kernel (PILOT_SPEED): the
  clock charges a micro-batch at the scenario's cost whatever its length and whatever the
  optimizer's kernel computes, and with rotary positions the parameters (so the bytes and the
  fragments) do not depend on the length, so only real compute shrinks (at 1 token instead
  of 8 the ranks of four pilots on 4site-10gbit-8b took 75 CPU s instead of 116; fused
  instead of foreach, example 1's ten pilots 0.90x the CPU seconds; paces the same);
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
from megatron_lsgd.core.output_files import write_text  # noqa: E402
from megatron_lsgd.training.scenario import Scenario  # noqa: E402
from tools.benchmarks.board.leaderboard_setup import MICRO_BATCH, PILOT_STEPS, cell_argv  # noqa: E402
from tools.benchmarks.recipes import LAYERS, TRAINED_PARAMS_GUESS, recommended, recommended_interval  # noqa: E402


# The recommended flags that follow H: an algorithm with any exchanges once per interval (the
# others every step), and a grid point at another H sets them as its recipe does at that H.
INTERVAL_FLAGS = ("--lsgd-interval", "--lsgd-aedit-interval-seconds", "--lsgd-fragment-sync-delay")
EVERY_STEP_PILOT = 50
PILOT_SEQ = 1
# What makes a pilot's real compute cheaper without touching what the clock charges (its numerics
# are not the board's; its paces are, module docstring): the short sequence, and AdamW's fused
# CPU kernel (a fifth of foreach's time over the stand-in's 1.49M parameters).
PILOT_SPEED = ("--seq-length", str(PILOT_SEQ), "--adam-kernel", "fused")
# --grid: each round-based algorithm also at these multiples of the recommended H; the streaming
# family also at these fragments (one: the whole model in one exchange; twice the stand-in's
# layers: smaller exchanges each); a compressing algorithm also with int4 by default, or any of
# GRID_COMPRESSIONS (--grid-compressions): their bytes per value do not depend on the matrices'
# shapes (quantization blocks and top-k chunks run across tensors), so the stand-in's scaled
# bytes are the target's; lowrank-int4's do (its factors follow each matrix's shape), so it is
# not offered.
GRID_FACTORS = (0.5, 2.0)
FRAGMENT_GRID = (1, 2 * LAYERS)
GRID_COMPRESSIONS = ("int8", "int4", "topk-2bit")
GRID_COMPRESSION = ("int4",)


@dataclass
class Pilot:
    """One pilot to run: an algorithm with the flags that follow its recommended ones."""
    algorithm: str
    extra: List[str] = field(default_factory=list)
    interval: Optional[int] = None  # H of a grid point (None: the recommended one)
    # the label's other differences from the recommended settings ("fragments=4", "compression=int4")
    differs: List[str] = field(default_factory=list)
    # the stand-in's flags, not settings: more layers for more fragments (a fragment needs a layer)
    stand_in: List[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return " ".join([self.algorithm] + ([f"H={self.interval}"] if self.interval is not None else [])
                        + self.differs)


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
    trained_params: Optional[float] = None  # the stand-in's, from the pilot's traffic (trained_params)


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


def _value(flags: Sequence[str], flag: str, default: str) -> str:
    return flags[flags.index(flag) + 1] if flag in flags else default


def fragment_points(algorithm: str, scenario: Scenario) -> List[Pilot]:
    """The streaming family at FRAGMENT_GRID fragments instead of its recommended one per layer
    of the stand-in: K that cut its round into whole slots longer than tau (as it requires). More
    fragments than the stand-in's layers train a stand-in of one layer per fragment: the clock
    charges the scenario's compute and scales the bytes to the target whatever the layers."""
    flags = recommended(algorithm, scenario)
    if "--lsgd-fragments" not in flags:
        return []
    h, tau = recommended_interval(scenario), int(_value(flags, "--lsgd-fragment-sync-delay", "0"))
    out = []
    for k in FRAGMENT_GRID:
        if str(k) == _value(flags, "--lsgd-fragments", "") or h % k or tau >= h // k:
            continue
        out.append(Pilot(algorithm, ["--lsgd-fragments", str(k)], differs=[f"fragments={k}"],
                         stand_in=["--num-layers", str(k)] if k > LAYERS else []))
    return out


def compression_points(algorithm: str, scenario: Scenario,
                       kinds: Sequence[str] = GRID_COMPRESSION) -> List[Pilot]:
    """An algorithm that takes a compressor with each of `kinds` but the one it is recommended
    with, and uncompressed when it is recommended compressed (dilocox: what its int4 buys).
    Where the sites differ in size, only a compressor the class weights by tokens
    (`unequal_sites_compressions`: the others are refused by pretrain_gpt.py)."""
    from megatron_lsgd.core.lsgd.catalog import synchronizer_class

    cls = synchronizer_class(algorithm)
    if "compression" not in cls.uses:
        return []
    own = _value(recommended(algorithm, scenario), "--lsgd-compression", "none")
    unequal = scenario.replicas_per_site and len(set(scenario.replicas_per_site)) > 1
    out = ["none"] if own != "none" else []
    out += [k for k in kinds if k != own and not (unequal and k not in cls.unequal_sites_compressions)]
    return [Pilot(algorithm, ["--lsgd-compression", kind], differs=[f"compression={kind}"]) for kind in out]


def base_pilot(algorithm: str, scenario: Scenario, uncompressed: bool = False) -> Pilot:
    """The algorithm at its recommended settings; `uncompressed` (sites of different layouts,
    whose layout-free exchange pretrain_gpt.py does not compress): without its compressor."""
    if uncompressed and _value(recommended(algorithm, scenario), "--lsgd-compression", "none") != "none":
        return Pilot(algorithm, ["--lsgd-compression", "none"], differs=["compression=none"])
    return Pilot(algorithm)


def grid(algorithms: Sequence[str], scenario: Scenario, uncompressed: bool = False,
         compressions: Sequence[str] = GRID_COMPRESSION) -> List[Pilot]:
    """Each algorithm at its recommended settings, and one setting at a time away from them: a
    round-based one at GRID_FACTORS x its H (whole fragments, with the flags that follow H as its
    recipe sets them there: the streaming family's tau, a-edit's interval of H steps' time), the
    streaming family at FRAGMENT_GRID fragments, a compressing one with its compression switched
    to each of `compressions` or off (compression_points; `uncompressed`: never compressed, as
    base_pilot). Not the inter-site
    backend: the clock's cost model does not read it."""
    h = recommended_interval(scenario)
    out = []
    for algorithm in algorithms:
        base = base_pilot(algorithm, scenario, uncompressed)
        out.append(base)
        if interval_flags(algorithm, scenario):
            for factor in GRID_FACTORS:
                hh = max(LAYERS, -(-int(round(h * factor)) // LAYERS) * LAYERS)
                if hh != h:
                    out.append(Pilot(algorithm, interval_flags(algorithm, scenario, hh) + base.extra, hh,
                                     differs=list(base.differs)))
        out += [Pilot(p.algorithm, p.extra + base.extra, p.interval, p.differs + base.differs, p.stand_in)
                for p in fragment_points(algorithm, scenario)]
        out += [] if uncompressed else compression_points(algorithm, scenario, compressions)
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


def trained_params(cell: Dict, sites: int) -> Optional[float]:
    """The stand-in's parameters, from what per-step sync would have moved in the pilot (its
    `sync_bytes`: each rank's fp32 ring all-reduce of its shard, sent + received, every step,
    summed over the ranks: 16 (S - 1) bytes per parameter of a replica per step). Exact where
    the sites step in lockstep (acco's and dpu's do not: there it is approximate)."""
    traffic = cell.get("traffic") or {}
    if not traffic.get("sync_bytes") or not cell.get("iterations"):
        return None
    return traffic["sync_bytes"] / (16 * (sites - 1) * cell["iterations"])


def pace_from_cell(pilot: Pilot, scenario: Scenario, steps: int, cell: Dict) -> Pace:
    # the board's stand-in is the board's count; another stand-in (more layers) counts its own
    trained = trained_params(cell, scenario.sites)
    scale = scenario.bytes_scale_for(trained if pilot.stand_in else TRAINED_PARAMS_GUESS)
    comm = cell.get("comm") or {}
    batches = global_batches(cell, scenario.sites, steps)
    return Pace(algorithm=pilot.algorithm, settings=merged(recommended(pilot.algorithm, scenario), pilot.extra),
                steps=steps, seconds_per_step=cell["seconds"] / batches,
                exposed_seconds_per_step=comm.get("exposed_seconds", 0.0) / batches,
                cross_site_bytes_per_step=cell["traffic"]["bytes"] * scale / batches, stats=cell.get("stats") or {},
                label=pilot.label, trained_params=trained)


def _argv(pilot: Pilot, scenario_path: str, scenario: Scenario, steps: int) -> List[str]:
    # the short sequence, the optimizer's kernel and the stand-in's layers are the pilot's, not
    # settings: they stay out of Pace.settings
    return cell_argv(scenario_path, pilot.algorithm, 1, steps, 0, scenario.sites,
                     extra=list(pilot.extra) + list(pilot.stand_in) + list(PILOT_SPEED))


def run_pilot(algorithm: str, scenario_path: str, scenario: Scenario, steps: int, extra: Sequence[str] = ()) -> Pace:
    """One pilot in ranks of its own."""
    from tools.benchmarks.board.leaderboard import run_cell  # spawns the ranks (imported late: torch.multiprocessing)

    pilot = Pilot(algorithm, list(extra))
    return pace_from_cell(pilot, scenario, steps, run_cell(_argv(pilot, scenario_path, scenario, steps),
                                                           scenario.sites))


PORT_WAIT_SECONDS = 600  # the other ranks wait this long for rank 0 to name a pilot's port


def _port_for(rank: int, folder: str) -> int:
    """A pilot's port, chosen by rank 0 when the pilot starts and read by the others from a
    file: chosen up front for every pilot, a port could be taken by another job in the minutes
    before its pilot (a grid's batch runs for many) and stop the batch."""
    path = os.path.join(folder, "port")
    if rank == 0:
        write_text(path, str(free_port()))  # atomic: whole or absent for the readers
    deadline = time.monotonic() + PORT_WAIT_SECONDS
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank 0 named no port for the pilot in {folder} within {PORT_WAIT_SECONDS} s")
        time.sleep(0.02)
    return int(open(path).read())


def _pilots_worker(rank: int, world: int, runs: List, out_dir: str, announce: bool) -> None:
    """Every pilot in turn, in this rank's one process: each joins a world of its own (a port
    of its own, _port_for) and leaves it before the next; the last rank announces each one's pace."""
    from tools.benchmarks.board.leaderboard import _worker

    for i, (label, argv) in enumerate(runs):
        start = time.monotonic()
        folder = os.path.join(out_dir, str(i))
        os.makedirs(folder, exist_ok=True)
        _worker(rank, world, _port_for(rank, folder), argv, folder)
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
    as one batch, each on a port chosen as it starts (_port_for); when the batch stops at a
    pilot, the unfinished ones run again as a batch (a port taken by another job between its
    choice and its use is the usual cause), and a pilot that stops it twice is reported and
    left out (None)."""
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
                run_ranks(_pilots_worker, (world, [(pilots[i].label, argvs[i]) for i in remaining],
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


__all__ = ["GRID_COMPRESSIONS", "Pace", "Pilot", "base_pilot", "compression_points", "fragment_points", "grid", "pilot_steps", "ranks_output_to", "run_pilot", "run_pilots", "LAYERS", "PILOT_SEQ"]
