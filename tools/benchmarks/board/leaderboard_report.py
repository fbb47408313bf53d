"""The leaderboard read from its finished cells (tools/benchmarks/board/leaderboard.py trains them):
each cell judged against sync's run of the same seed, a table and a plot per scenario, the
open targets of earlier rounds, and the document docs/leaderboard.md."""

from __future__ import annotations

import math
import os
import re
import statistics
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from megatron_lsgd.core.simulation import CLOCK_MODEL
from megatron_lsgd.training.scenario import load_scenario
from megatron_lsgd.core.output_files import save_figure
from tools.benchmarks.board.leaderboard_setup import (EVALUATIONS, FREE_LINK, ROOT, SCENARIO_DIR, SEQ, TOY,
                                                      board_cells, compact, unequal_refusals)
from tools.benchmarks.recipes import ACCO_FIXED, ALGORITHMS, MAX_MICROBATCHES, TRAINED_PARAMS_GUESS, recommended_interval
from tools.benchmarks.quality.lsgd_quality import steps_to_reach


def steps_to(cell: Dict, target: float) -> Optional[float]:
    return steps_to_reach(cell["valid_iterations"], cell["valid"], target)


def median_of(values: List[Optional[float]]) -> Optional[float]:
    """The median over seeds of a time (or steps) to a target, a seed that did not reach it
    (None) counting as never: None when that median is never (half the seeds or more did not
    reach it). With 2 of 3 seeds it is the slower of the two, not their mean."""
    if not values:
        return None
    median = statistics.median([math.inf if v is None else v for v in values])
    return None if math.isinf(median) else median


def seed_of(cell: Dict) -> int:
    argv = cell.get("argv", [])
    return int(argv[argv.index("--seed") + 1]) if "--seed" in argv else 1


class Targets:
    """Each cell is judged against sync's run with the same seed (same initialization and data
    order, which can move the loss by more than the gaps between algorithms): its
    final validation loss, and its whole run's time as the budget. Seeds sync did not run
    fall back to the median over sync's seeds."""

    def __init__(self, cells: Dict[str, List[Dict]], looser: float = 1.0):
        sync = cells.get("sync", [])
        self.loss = {seed_of(c): c["valid"][-1] * looser for c in sync}
        self.seconds = {seed_of(c): c["seconds"] for c in sync}
        self.median_loss = statistics.median(self.loss.values()) if sync else None
        self.median_seconds = statistics.median(self.seconds.values()) if sync else None

    def loss_for(self, cell: Dict) -> float:
        return self.loss.get(seed_of(cell), self.median_loss)

    def budget_for(self, cell: Dict) -> float:
        return self.seconds.get(seed_of(cell), self.median_seconds)


@dataclass(frozen=True)
class OpenTarget:
    """measure(candidate) / measure(reference) on one scenario's cells, judged against a bar
    (`inverted`: the reference's over the candidate's, so that higher is better)."""

    what: str
    scenario: str
    bar: str
    candidate: str
    reference: str
    measure: str  # "time" (simulated seconds) or "steps" to the target
    met: Callable[[float], bool]
    inverted: bool = False
    loose: bool = False  # the +2% target instead of sync's final loss


OPEN_TARGETS = (
    OpenTarget("a-edit, one site 2x slower: time to the +2% target on a free link (its ceiling) / a-edit's",
               "emulated-straggler2x", ">= 0.90", "a-edit", f"a-edit ({FREE_LINK})", "time", lambda r: r >= 0.90,
               inverted=True, loose=True),
    OpenTarget("acco, one site 4x slower: time to sync's final loss, acco / sync", "emulated-1gbit-straggler4x",
               "<= 0.5", "acco", "sync", "time", lambda r: r <= 0.5),
    OpenTarget("the same, acco with fixed per-site counts 8,2 (the scenario's tuned variant)",
               "emulated-1gbit-straggler4x", "<= 0.5", ACCO_FIXED, "sync", "time", lambda r: r <= 0.5),
    OpenTarget("cocodc vs streaming-diloco: steps to sync's final loss, cocodc / streaming-diloco",
               "emulated-default", "< 1", "cocodc", "streaming-diloco", "steps", lambda r: r < 1.0),
    OpenTarget("dreamddp vs diloco: time to sync's final loss, dreamddp / diloco", "emulated-default", "< 1",
               "dreamddp", "diloco", "time", lambda r: r < 1.0),
)


def judge(target: OpenTarget, cells: Dict[str, List[Dict]]) -> Tuple[str, str]:
    """(measured, met) for one open target from a scenario's cells."""
    if "sync" not in cells or target.candidate not in cells or target.reference not in cells:
        return "not run", ""
    goal = Targets(cells, 1.02 if target.loose else 1.0)
    measure = time_to if target.measure == "time" else steps_to
    unit = " s" if target.measure == "time" else " steps"
    a = median_of([measure(c, goal.loss_for(c)) for c in cells[target.candidate]])
    b = median_of([measure(c, goal.loss_for(c)) for c in cells[target.reference]])
    if a is None and b is None:
        return "neither reaches it", "**no**"
    if a is None or b is None:  # only one reaches it: the candidate wins exactly when it is that one
        who = target.candidate if a is not None else target.reference
        return f"only {who} reaches it", "yes" if who == target.candidate else "**no**"
    value = b / a if target.inverted else a / b
    n = len(cells[target.candidate])  # a target the seeds' spread covers reads differently at 3 and at 5
    seeds = f"{n} seed" + ("s" if n != 1 else "")
    return f"{value:.3g} ({a:.4g}{unit} vs {b:.4g}{unit}; {seeds})", "yes" if target.met(value) else "**no**"


def open_targets(board: Dict[str, Dict[str, List[Dict]]]) -> List[str]:
    """The targets earlier rounds could not judge on a noisy real clock, re-judged here."""
    lines = ["| target | scenario | bar | measured (candidate vs reference) | met |", "|---|---|---|---|---|"]
    for target in OPEN_TARGETS:
        measured, met = judge(target, board.get(target.scenario, {}))
        lines.append(f"| {target.what} | {target.scenario} | {target.bar} | {measured} | {met} |")
    return lines


def time_to(cell: Dict, target: float) -> Optional[float]:
    return steps_to_reach(cell["valid_seconds"], cell["valid"], target)


def loss_at(cell: Dict, budget: float) -> Optional[float]:
    """The last validation loss measured at or before `budget` simulated seconds."""
    seen = [loss for t, loss in zip(cell["valid_seconds"], cell["valid"]) if t <= budget]
    return seen[-1] if seen else None


def time_spread(values: List[Optional[float]]) -> str:
    """A time (or steps) to a target over seeds: median_of (the ranking's key) and [min, max],
    the max 'not reached' when a seed did not reach it."""
    got = [v for v in values if v is not None]
    median = median_of(values)
    if median is None:
        return "not reached" + (f" ({len(got)} of {len(values)} seeds did: {', '.join(f'{v:.4g}' for v in got)})"
                                if got else "")
    if len(values) == 1:
        return f"{median:.4g}"
    high = f"{max(got):.4g}" if len(got) == len(values) else "not reached"
    text = f"{median:.4g} [{min(got):.4g}, {high}]"
    if len(got) < len(values):
        text += f" ({len(values) - len(got)} of {len(values)} seeds not reached)"
    return text


def spread(values: List[Optional[float]]) -> str:
    got = [v for v in values if v is not None]
    if not got:
        return "not reached"
    text = f"{statistics.median(got):.4g}"
    if len(got) > 1:
        text += f" [{min(got):.4g}, {max(got):.4g}]"
    if len(got) < len(values):
        text += f" ({len(values) - len(got)} of {len(values)} seeds not reached)"
    return text


def clock_model_of(cell: Dict) -> int:
    """The simulated clock's model version a cell was trained under (core/simulation.py's
    CLOCK_MODEL); cells from before it was recorded are of model 1."""
    return int(cell.get("clock_model", 1))


def older_model_note(name: str, cells: Dict[str, List[Dict]]) -> List[str]:
    """A line for a table some of whose cells were trained under an older clock model (none
    when every cell is of the current one): their times are not comparable with the current
    model's, so the table says so until they are trained again."""
    every = [c for runs in cells.values() for c in runs]
    old = [c for c in every if clock_model_of(c) != CLOCK_MODEL]
    if not old:
        return []
    models = ", ".join(str(m) for m in sorted({clock_model_of(c) for c in old}))
    return [f"**Made under an older simulated clock:** {len(old)} of these {len(every)} cells were trained under "
            f"clock model {models}, not the current {CLOCK_MODEL} (core/simulation.py, CLOCK_MODEL: model 1 charged "
            f"one one-way delay per collective where model 2 charges one per phase, 2 (S - 1) for a ring "
            f"all-reduce). Their times are not comparable with the current model's until "
            f"`python -m tools.bench board --scenarios {name}` trains them again.", ""]


def summarize(name: str, scenario, cells: Dict[str, List[Dict]]) -> List[str]:
    sync = cells.get("sync")
    if not sync:
        return [f"### {name}", "", "(no sync cells: no target)"]
    target, loose = Targets(cells), Targets(cells, 1.02)
    rows = []
    for algo, runs in cells.items():
        times = [time_to(c, target.loss_for(c)) for c in runs]
        loose_times = [time_to(c, loose.loss_for(c)) for c in runs]
        key = median_of(times)
        key = math.inf if key is None else key
        updates = [c["iterations"] / c["seconds"] for c in runs]
        tokens = [c["samples"] * seq_of(c) / c["seconds"] for c in runs]
        rows.append((key, algo, spread([c.get("steps", c["iterations"]) for c in runs]), time_spread(times),
                     time_spread(loose_times),
                     spread([loss_at(c, target.budget_for(c)) for c in runs]),
                     spread([c["valid"][-1] for c in runs]), spread(updates), spread(tokens),
                     spread([c["traffic"].get("bytes", 0) / 2**20 for c in runs]),
                     spread([c["peak_rss_mb"] for c in runs])))
    rows.sort(key=lambda r: (r[0], r[1]))
    lines = [f"### {name}", ""] + older_model_note(name, cells) + [f"{scenario.description}. Target: the final validation loss of sync's run with "
             f"the same seed (median over {len(sync)} seed{'s' if len(sync) > 1 else ''} {target.median_loss:.4f}), "
             f"and that + 2%; budget: "
             f"the simulated time of that sync run (median {target.median_seconds:.1f} s). H = "
             f"{recommended_interval(scenario)} for the DiLoCo family.", "",
             "| rank | algorithm | steps | time to target (s) | time to +2% (s) | val loss at budget | final val loss | "
             "updates/s | tokens/s | cross-site MB | peak RSS MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    rank = 0
    for r in rows:
        ceiling = FREE_LINK in r[1]  # not a contender: what the algorithm would do if the link were free
        rank += 0 if ceiling else 1
        lines.append(f"| {'ceiling' if ceiling else rank} | {r[1]} | " + " | ".join(r[2:]) + " |")
    return lines + unequal_note(scenario)


def unequal_note(scenario) -> List[str]:
    """Under the table of a scenario whose sites differ in size: its layout, and the algorithms
    that refuse it with their reasons (they have no row)."""
    if not scenario.replicas_per_site:
        return []
    sizes = ",".join(map(str, scenario.replicas_per_site))
    refused = unequal_refusals(scenario, ALGORITHMS)
    return ["", f"Sites of {sizes} data-parallel replicas (`--site-data-parallel-sizes {sizes}`, one rank per "
                f"replica). Not run, as they refuse sites of different sizes "
                f"([heterogeneous_sites.md](heterogeneous_sites.md)): "
            + "; ".join(f"{a} ({why})" for a, why in refused.items()) + "."]


def plot(name: str, cells: Dict[str, List[Dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    if cells.get("sync"):
        ax.axhline(cells["sync"][0]["valid"][-1], color="grey", linestyle="--", linewidth=0.8,
                   label="target: sync's final loss")
    for algo, runs in cells.items():
        c = runs[0]
        ax.plot(c["valid_seconds"], c["valid"], marker=".", label=algo)
    ax.set_xscale("log")  # the algorithms' times to a loss differ by 10x and more
    ax.set_xlabel("simulated training time (s, log scale)")
    ax.set_ylabel("validation loss")
    ax.set_title(f"{name} (seed 1)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)


def scenario_table(names: List[str]) -> List[str]:
    lines = ["| scenario | sites | micro-batch s | optimizer step s | link Mbit/s | one way ms | bytes x | "
             "compute s per MB sent | site factors | derived |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name in names:
        s = load_scenario(os.path.join(SCENARIO_DIR, f"{name}.toml"))
        scale = s.bytes_scale_for(TRAINED_PARAMS_GUESS)
        rates = "/".join(f"{r:g}" for r in sorted(set(s.rate_mbit)))
        delays = "/".join(f"{d:g}" for d in sorted(set(s.latency_ms)))
        lines.append(f"| {name} | {s.sites} | {s.microbatch_seconds:.4g} | {s.optimizer_step_seconds:.4g} | {rates} | "
                     f"{delays} | {scale:.4g} | {s.cpu_seconds_per_mb:g} | {'/'.join(f'{x:g}' for x in s.site_factors)} | "
                     f"{'; '.join(s.derived.values()) or 'given'} |")
    return lines


def cost_line(spent: Dict[str, List[Optional[float]]]) -> List[str]:
    """What training the board's cells (pilots included) cost this machine in real time, in all
    and per scenario: the price of regenerating it (a cell trained before cells kept their real
    time has none)."""
    known = {n: times for n, v in spent.items() if (times := [s for s in v if s is not None])}
    if not known:
        return []
    cells = sum(len(v) for v in spent.values())
    unknown = cells - sum(len(v) for v in known.values())
    per = ", ".join(f"{n} {sum(v) / 60:.0f} min" for n, v in known.items())
    line = (f"Cost: training these {cells} cells (pilots included) took {sum(map(sum, known.values())) / 3600:.1f} h "
            f"of this machine's real time ({per})")
    return [line + (f"; {unknown} cell(s) did not keep theirs." if unknown else "."), ""]


LINK = re.compile(r"\]\(([^)\s#:]+)(#[^)\s]*)?\)")  # a relative link: not http:, not only #anchor


def included(path: str, page: str) -> str:
    """The text of a reading at `path` as it reads inside `page`: its relative links, written
    from the reading's directory, rebased to the page's."""
    with open(path) as f:
        text = f.read().strip()
    here, there = os.path.dirname(os.path.abspath(path)), os.path.dirname(os.path.abspath(page))

    def rebase(m: "re.Match") -> str:
        return f"]({os.path.relpath(os.path.join(here, m.group(1)), there)}{m.group(2) or ''})"
    return LINK.sub(rebase, text)


def latest_archive() -> Optional[str]:
    """The newest archived board (docs/leaderboard/archive-<date>.md), if any: a board published
    before its cells were kept, the last word on the scenarios not trained again since."""
    folder = os.path.join(ROOT, "docs", "leaderboard")
    pages = sorted(n for n in os.listdir(folder) if n.startswith("archive-") and n.endswith(".md"))
    return os.path.join(folder, pages[-1]) if pages else None


def seq_of(cell: Dict) -> int:
    """The sequence length a cell trained (its flags; the toy's for a cell without them)."""
    argv = cell.get("argv") or []
    return int(argv[argv.index("--seq-length") + 1]) if "--seq-length" in argv else SEQ


def document(names: List[str], sections: List[str], args, not_run: Dict[str, List[str]],
             spent: Optional[Dict[str, List[Optional[float]]]] = None) -> str:
    """docs/leaderboard.md: the method, the scenarios, every table, and the simulator's validation."""
    validation = os.path.join(ROOT, "docs", "leaderboard", "validation.md")  # whichever board: the simulator's
    # the cells are measured data, kept under results/ (leaderboard.py's CELLS_DIR), the board a page in docs/
    cells = getattr(args, "cache_dir", None) or os.path.join(ROOT, "results", "leaderboard", "cells")
    cells_link = os.path.relpath(os.path.abspath(cells), os.path.dirname(os.path.abspath(args.out)))
    stand_in = getattr(args, "stand_in_obj", TOY)
    head = [
        "# Leaderboard: time to a validation loss, per WAN scenario"
        + ("" if stand_in is TOY else f" ({stand_in.name}: the target from a trained model)"),
        "",
        "Written by `python -m tools.bench board` (resumable; see its docstring); this board by "
        f"`python -m tools.bench board {' '.join(sys.argv[1:])}`. Its cells, the data of every table, "
        f"are committed in [{cells_link}]({cells_link}/README.md): `--cached-only` rewrites this page from "
        "them, and a run with more seeds or scenarios trains only the cells they lack.",
        "",
        "Every cell trains the",
        f"same GPT ({' '.join(stand_in.model[:8])}, micro-batch {stand_in.micro_batch} x {stand_in.seq} tokens, "
        "one micro-batch per site per "
        "step) with one rank per site, on the **simulated clock** of the scenario: compute costs come from",
        "the scenario's cost model and cross-site collectives from its link model (docs/architecture.md, 'Time'),",
        "so the seconds below are simulated seconds of that scenario, identical on every re-run and",
        "independent of this machine's load. They are not measurements of real hardware. They are training",
        "time: the time spent evaluating (its forward passes, and the wait for communication in flight that",
        "an evaluation must finish first) is left out, as Megatron's iteration timers leave it out.",
        "",
        f"Every algorithm gets the same time: sync trains {args.steps} steps, and its simulated training time is",
        f"the budget. Each other algorithm first runs a pilot of {args.steps} steps without evaluation, which",
        "measures its pace on the scenario's clock (the pace depends neither on the seed nor on the data), and",
        "then trains as many steps as fit in the budget at that pace, with its learning-rate schedule",
        f"(warm-up, cosine decay) sized to them, but at most {args.budget_cap}x sync's steps, which is what this machine",
        f"can afford; the `steps` column says how many. About {EVALUATIONS} evaluations per run, each over",
        f"{stand_in.about}: the same samples in",
        f"every evaluation of every cell. acco and dpu accumulate at most {MAX_MICROBATCHES} micro-batches per stage.",
        "",
        "How to read a table: the ranking is by the median over seeds of the simulated time to reach the",
        "final validation loss of sync's run with the same seed (paired: the seed sets the initialization",
        "and the training data order; a seed that does not reach it counts as never, so with 2 of 3 seeds",
        "the median is the slower of the two, and an algorithm whose median is never ranks last).",
        "`val loss at budget` is the last evaluation within sync's time (an algorithm capped at fewer steps",
        "than fit ends before the budget: its last evaluation). `updates/s` is",
        "optimizer steps per simulated second; `tokens/s` counts computed tokens and is not speed when an",
        "algorithm changes its batch (acco/dpu adaptive accumulation). Spread is [min, max] over seeds.",
        "Cross-site MB is what all ranks sent and received in the run. Peak RSS is real memory of the largest rank.",
        "",
        "## Scenarios",
        "",
    ] + scenario_table(names) + [
        "",
        "Bytes x is target parameters / trained parameters for the leaderboard model (about "
        f"{TRAINED_PARAMS_GUESS / 1e6:.1f}M with the 8k vocabulary). Compute s per MB sent is the CPU a "
        "cross-site transfer takes from the rank that sends it (the network stack sharing the ranks' cores): "
        "non-zero only in a scenario calibrated against this machine's emulated WAN by its collective probe "
        "(`validate_clock.py --probe-only`); a GPU's NIC moves the bytes without the compute's cores.",
        "",
        "## Results",
        "",
    ]
    every = sorted(n[:-5] for n in os.listdir(SCENARIO_DIR) if n.endswith(".toml"))
    missing = [n for n in every if n not in names or len(not_run.get(n, [])) == len(board_cells(n, args))]
    if missing or len(args.seeds) < 3 or any(not_run.values()):
        head += [f"**Partial board:** {len(args.seeds)} seed(s); scenarios not run: {', '.join(missing) or 'none'}. "
                 "Regenerate with `python -m tools.bench board` (every scenario, 3 seeds)."]
        archive = latest_archive()
        if missing and archive:
            link = os.path.relpath(archive, os.path.dirname(os.path.abspath(args.out)))
            head += [f"The last tables of the scenarios not run here, trained at earlier code whose cells were not "
                     f"kept: [{os.path.basename(archive)[:-3]}]({link})."]
        head += [f"Cells not run in {n}: {', '.join(compact(cells, n, args))}." for n, cells in not_run.items()
                 if cells and n not in missing]
        head += [""]
    head += cost_line(spent or {})
    tail = ["", "## Validation of the simulator", ""]
    if os.path.exists(validation):
        with open(validation) as f:
            tail.append(f.read())
    else:
        tail.append("Not run yet: `python -m tools.bench validate` (on a quiet machine) compares every "
                    "algorithm's simulated time per step and ratio to the ceiling with the real emulated WAN "
                    "(tools/wan) and writes its table here.")
    return "\n".join(head + sections + tail)
