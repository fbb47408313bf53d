"""The leaderboard: which algorithm reaches a validation loss first, per WAN scenario, on the
simulated clock (`--simulate-clock`, core/simulation.py), so the figures do not depend on
this machine's load and two runs of a cell give the same numbers.

For every scenario (tools/benchmarks/scenarios/*.toml) and every algorithm with its
recommended settings for that scenario (below), over several seeds, it trains the same small
GPT on the bundled corpus (data/python-docs; every evaluation covers the whole held-out split,
--full-validation), one rank per site, for the same simulated time: sync trains --steps
steps and its training time is the budget; every other algorithm runs a pilot of --steps
steps (its pace on the scenario's clock) and then the steps that fit in the budget at that
pace, at most --budget-cap x --steps, its learning-rate schedule sized to them. Per cell:
- simulated time to the target validation loss (the final validation loss of sync's run with
  the same seed: a paired comparison) and to a looser target (that + 2%), interpolated
  between evaluations;
- validation loss at the budget (the last evaluation within sync's time);
- updates/s and tokens/s on the simulated clock, cross-site bytes (all ranks), peak RSS.
Times are training time: evaluation is left out. It writes docs/leaderboard.md (tables
ranked by time to target, median and spread over seeds) and one plot per scenario
(validation loss vs simulated time, every algorithm).

    python tools/benchmarks/leaderboard.py                  # everything (resumable)
    python tools/benchmarks/leaderboard.py --scenarios emulated-default --algorithms sync,diloco --seeds 1

In scenarios with a slow site, a-edit also runs on a copy of the scenario whose link is free
(same compute, same settings): its ceiling. A scenario may list tuned variants (VARIANTS:
an algorithm with flags after its recommended ones, a row of its own with its own pilot),
where a target's miss asks what a user who knows the scenario would set. The board ends
with the open targets of earlier rounds (a-edit and acco under a slow site, cocodc vs
streaming-diloco, dreamddp vs diloco), judged from the cells.

A person's reading of a table goes in docs/leaderboard/<scenario>.reading.md (and
targets.reading.md), which the board includes under the table, so regenerating keeps it.

Finished cells are cached as JSON under --cache-dir, named by a digest of their flags and
scenario file, and reused; delete a file to re-run it. Each keeps a fingerprint of every
argument its flags resolve to: a cell cached under defaults changed since is trained again
(cells cached before fingerprints existed are taken as they are).

Recommended settings: the outer interval H of the DiLoCo family is chosen per scenario so
that one full-model exchange costs at most a tenth of H steps of compute,
H = clamp(ceil(10 x exchange / step), 5, 100), from the scenario's own cost and link model
(the exchange is bytes / rate + latency: a calibrated scenario's CPU per MB sent is left out;
counted, it would move emulated-straggler2x's H from 78 to 82 and emulated-1gbit-straggler4x's
from 12 to 14), rounded up to whole fragments (printed with the table); dilocox uses int4,
streaming-diloco/cocodc one fragment per layer with tau = min(5, H / 8), acco/dpu their
adaptive accumulation, at most MAX_MICROBATCHES per stage (acco from two micro-batches per
site per step, one per stage: it cannot take one), a-edit an interval of H steps' time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from megatron_lsgd.core.lsgd.catalog import synchronizer_class  # noqa: E402
from megatron_lsgd.training.initialize import free_port  # noqa: E402
from megatron_lsgd.training.scenario import load_scenario  # noqa: E402
from tools.benchmarks.lsgd_quality import steps_to_reach  # noqa: E402
from tools.benchmarks.run_cache import load_or_run, relative_flags, resolved_fingerprint  # noqa: E402

SCENARIO_DIR = os.path.join(ROOT, "tools", "benchmarks", "scenarios")
DATA = os.path.join(ROOT, "data", "python-docs")
ALGORITHMS = ("sync", "diloco", "dilocox", "streaming-diloco", "cocodc", "dreamddp", "dpu", "acco", "edit", "a-edit")

# The small GPT every cell trains (its parameter count sets the bytes a step exchanges).
SEQ = 64
LAYERS = 2  # also the streaming family's fragments (one layer each)
MODEL = ["--num-layers", str(LAYERS), "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", str(SEQ),
         "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
         "--hidden-dropout", "0", "--attention-dropout", "0"]
MICRO_BATCH = 4
TRAINED_PARAMS_GUESS = 1_491_584  # the model above with the 8k vocabulary (each run prints its count)


# The held-out split every evaluation covers in full (--full-validation): about 2% of the
# corpus, the same samples in every evaluation of every cell, so that curves and seeds compare.
SPLIT = "979,20,1"
# acco/dpu accumulate while the exchange is in flight; at most this many micro-batches per
# stage (16 x the minimum by default) keeps a cell's real compute within a few minutes.
MAX_MICROBATCHES = 4
# Evaluations per run (the interval scales with the run's length).
EVALUATIONS = 12


def data_args() -> List[str]:
    return ["--data-path", os.path.join(DATA, "python_docs_text_document"), "--split", SPLIT,
            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", os.path.join(DATA, "python_docs_sp8k.model")]


def recommended_interval(scenario) -> int:
    """H such that one full-model exchange costs at most a tenth of H steps' compute, rounded
    up to a multiple of the streaming family's fragments (a round is cut into equal slots)."""
    step = scenario.microbatch_seconds * max(scenario.site_factors) + scenario.optimizer_step_seconds
    scale = scenario.bytes_scale_for(TRAINED_PARAMS_GUESS)
    nbytes = 4 * TRAINED_PARAMS_GUESS * scale * 2 * (scenario.sites - 1) / scenario.sites
    rate = min(scenario.rate_mbit) * 1e6
    exchange = (nbytes * 8 / rate if rate > 0 else 0.0) + max(scenario.latency_ms) / 1e3
    h = int(min(100, max(5, math.ceil(10 * exchange / step))))
    return -(-h // LAYERS) * LAYERS


def recommended(algorithm: str, scenario) -> List[str]:
    h = recommended_interval(scenario)
    step = scenario.microbatch_seconds + scenario.optimizer_step_seconds
    outer = ["--lsgd-interval", str(h), "--lsgd-outer-lr", "1.0", "--lsgd-outer-momentum", "0.0"]
    fragments = ["--lsgd-fragments", str(LAYERS), "--lsgd-fragment-sync-delay", str(min(5, max(1, h // 8)))]
    return {
        "sync": [],
        "diloco": outer,
        "dilocox": outer + ["--lsgd-compression", "int4"],
        "streaming-diloco": outer + fragments,
        "cocodc": outer + fragments,
        "dreamddp": ["--lsgd-interval", str(h)],
        "dpu": ["--lsgd-max-microbatches", str(MAX_MICROBATCHES)],
        # acco splits a step into an estimate and a real stage of at least one micro-batch
        # each: two per site per step, twice the others' minimum (adaptive accumulation adds more).
        "acco": ["--lsgd-site-microbatches", ",".join(["2"] * scenario.sites),
                 "--lsgd-max-microbatches", str(MAX_MICROBATCHES)],
        "edit": outer,
        "a-edit": ["--lsgd-aedit-interval-seconds", f"{h * step:.4g}", "--lsgd-outer-lr", "1.0",
                   "--lsgd-outer-momentum", "0.0"],
    }[algorithm]


def cell_argv(scenario_path: str, algorithm: str, seed: int, steps: int, eval_interval: int, sites: int,
              settings_from: Optional[str] = None, extra: Sequence[str] = ()) -> List[str]:
    """The cell's flags; the recommended settings come from `settings_from` (a free-link
    ceiling keeps the settings of the scenario it is the ceiling of) or the scenario itself,
    and a tuned variant's `extra` flags follow them (the last of a flag given twice counts).
    `eval_interval` 0: no evaluation (a pilot, which only measures the pace)."""
    gbs = MICRO_BATCH * sites  # one micro-batch per site per step
    evaluation = ["--eval-interval", str(eval_interval), "--eval-iters", "1", "--full-validation"] if eval_interval \
        else ["--eval-iters", "0"]
    argv = MODEL + data_args() + [
        "--micro-batch-size", str(MICRO_BATCH), "--global-batch-size", str(gbs), "--lr", "2e-3", "--min-lr", "2e-4",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", str(max(1, steps // 20)), "--weight-decay", "0.1",
        "--clip-grad", "1.0", "--seed", str(seed), "--num-sites", str(sites), "--log-interval", str(steps),
        *evaluation, "--simulate-scenario", scenario_path, "--lsgd-algorithm", algorithm]
    argv += recommended(algorithm, load_scenario(settings_from or scenario_path)) + list(extra)
    if synchronizer_class(algorithm).lockstep:
        argv += ["--train-iters", str(steps)]
    else:  # sites take different numbers of steps: the same budget in samples
        argv += ["--train-samples", str(steps * gbs)]
    return argv


def _worker(rank: int, world: int, port: int, argv: List[str], out_dir: str) -> None:
    import resource

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import pretrain_gpt
    from megatron_lsgd.training.initialize import shutdown_distributed

    result = pretrain_gpt.main(argv)
    record = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if rank == world - 1:  # the logging rank (last site)
        record.update(valid=result.validation_losses, valid_seconds=result.validation_seconds,
                      valid_iterations=result.validation_iterations,
                      seconds=result.clock_seconds - result.evaluation_seconds,  # training time
                      evaluation_seconds=result.evaluation_seconds,
                      iterations=result.iteration, samples=result.consumed_samples, traffic=result.traffic,
                      stats=result.sync_stats)
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(record, f)
    shutdown_distributed()


def run_cell(argv: List[str], world: int) -> Dict:
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, free_port(), argv, d), nprocs=world, join=True)
        records = [json.load(open(os.path.join(d, f"{r}.json"))) for r in range(world)]
    out = records[-1]
    out["peak_rss_mb"] = max(r["peak_rss_mb"] for r in records)
    return out


def measure_costs(short: int = 10, long: int = 50) -> float:
    """CPU seconds per step of MODEL on one rank, one thread (forward+backward of one
    micro-batch and the optimizer step): the difference of two runs' CPU time, so start-up
    and the machine's load (mostly) drop out. This is what emulated-default.toml uses."""
    import resource

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.set_num_threads(1)
    import pretrain_gpt
    from megatron_lsgd.training.initialize import shutdown_distributed

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    spent = {}
    for iters in (short, long):
        start = cpu()
        pretrain_gpt.main(MODEL + data_args() + ["--micro-batch-size", str(MICRO_BATCH), "--global-batch-size",
                                                 str(MICRO_BATCH), "--train-iters", str(iters), "--lr", "1e-3",
                                                 "--log-interval", str(10 * long), "--eval-iters", "0"])
        spent[iters] = cpu() - start
        shutdown_distributed()
    return (spent[long] - spent[short]) / (long - short)


# Algorithms that also run on a free link in scenarios with a slow site: what the link costs
# them in progress (a-edit's target is measured against this ceiling).
CEILING_ALGORITHMS = ("a-edit",)
FREE_LINK = "free link"

# Tuned variants per scenario: (label, algorithm, flags after the recommended ones), rows of
# their own beside the recommended settings, where a target's miss asks what a user who knows
# the scenario would set. acco with one site 4x slower: its adaptive accumulation makes the
# slow site add a whole 4x micro-batch while each exchange finishes, so fixed counts in
# proportion to the sites' speeds (4 + 4 micro-batches per step on the fast site, 1 + 1 on the
# slow one) keep the fast site's work without slowing the slow site's stage.
ACCO_FIXED = "acco (fixed 8,2)"
VARIANTS: Dict[str, Tuple[Tuple[str, str, Tuple[str, ...]], ...]] = {
    "emulated-1gbit-straggler4x": (
        (ACCO_FIXED, "acco", ("--lsgd-accumulation", "fixed", "--lsgd-site-microbatches", "8,2")),
    ),
}


@dataclass(frozen=True)
class Run:
    """One row of a scenario's table: an algorithm on a scenario file, with a variant's flags."""
    label: str
    algorithm: str
    scenario_path: str
    extra: Tuple[str, ...] = ()

    @property
    def plan(self) -> Tuple[str, Tuple[str, ...]]:
        """What sets its pace, so its pilot: a free-link ceiling shares its algorithm's."""
        return self.algorithm, self.extra


def free_link_copy(path: str, out_dir: str) -> str:
    """The scenario with an unlimited link and no latency (same compute, same slow sites):
    the ceiling a cross-site algorithm would reach if communication cost nothing."""
    import tomllib

    with open(path, "rb") as f:
        data = tomllib.load(f)
    name = os.path.basename(path)[:-5]
    lines = [f"# {name} with a free link (written by leaderboard.py: the ceiling)",
             f"description = {json.dumps(data.get('description', name) + ', link free')}",
             f"sites = {data['sites']}", "", "[compute]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in data.get("compute", {}).items()]
    lines += ["", "[link]", "rate_mbit = 0", "latency_ms = 0"]
    link = data.get("link", {})
    lines += [f"{k} = {json.dumps(link[k])}" for k in ("bytes_scale", "target_params") if k in link]
    out = os.path.join(out_dir, f"{name}.free-link.toml")
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    return out


def has_slow_site(scenario) -> bool:
    return any(f != scenario.site_factors[0] for f in scenario.site_factors)


def budget_steps(steps: int, budget: float, pilot_seconds: float, cap: int) -> int:
    """Steps that fit in sync's training time at the pace of the algorithm's pilot run (`steps`
    steps in `pilot_seconds`): at least `steps` (an algorithm slower than sync gets sync's
    steps), at most `cap` x `steps` (what this machine can afford)."""
    if pilot_seconds <= 0:
        return cap * steps
    return int(min(cap * steps, max(steps, math.floor(steps * budget / pilot_seconds))))


def eval_interval_for(steps: int) -> int:
    """About EVALUATIONS evaluations per run, whatever its length."""
    return max(1, round(steps / EVALUATIONS))


def steps_to(cell: Dict, target: float) -> Optional[float]:
    return steps_to_reach(cell["valid_iterations"], cell["valid"], target)


def median_of(values: List[Optional[float]]) -> Optional[float]:
    """The median over seeds, or None when most seeds did not reach the target."""
    got = [v for v in values if v is not None]
    return statistics.median(got) if len(got) * 2 > len(values) else None


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
    return f"{value:.3g} ({a:.4g}{unit} vs {b:.4g}{unit})", "yes" if target.met(value) else "**no**"


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
        tokens = [c["samples"] * SEQ / c["seconds"] for c in runs]
        rows.append((key, algo, spread([c.get("steps", c["iterations"]) for c in runs]), spread(times),
                     spread(loose_times),
                     spread([loss_at(c, target.budget_for(c)) for c in runs]),
                     spread([c["valid"][-1] for c in runs]), spread(updates), spread(tokens),
                     spread([c["traffic"].get("bytes", 0) / 2**20 for c in runs]),
                     spread([c["peak_rss_mb"] for c in runs])))
    rows.sort(key=lambda r: (r[0], r[1]))
    lines = [f"### {name}", "", f"{scenario.description}. Target: the final validation loss of sync's run with "
             f"the same seed (median over {len(sync)} seeds {target.median_loss:.4f}), and that + 2%; budget: "
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
    return lines


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
    fig.savefig(path, dpi=110)
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


def document(names: List[str], sections: List[str], args, not_run: Dict[str, List[str]]) -> str:
    """docs/leaderboard.md: the method, the scenarios, every table, and the simulator's validation."""
    validation = os.path.join(os.path.dirname(args.out), "leaderboard", "validation.md")
    head = [
        "# Leaderboard: time to a validation loss, per WAN scenario",
        "",
        "Written by `python tools/benchmarks/leaderboard.py` (resumable; see its docstring); this board by "
        f"`python tools/benchmarks/leaderboard.py {' '.join(sys.argv[1:])}`.",
        "",
        "Every cell trains the",
        f"same GPT ({' '.join(MODEL[:8])}, micro-batch {MICRO_BATCH} x {SEQ} tokens, one micro-batch per site per "
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
        f"can afford; the `steps` column says how many. About {EVALUATIONS} evaluations per run, each over the whole",
        f"held-out split of the bundled corpus (`--split {SPLIT}` with `--full-validation`): the same samples in",
        f"every evaluation of every cell. acco and dpu accumulate at most {MAX_MICROBATCHES} micro-batches per stage.",
        "",
        "How to read a table: the ranking is by the median over seeds of the simulated time to reach the",
        "final validation loss of sync's run with the same seed (paired: the seed sets the initialization",
        "and the training data order; an algorithm that does not reach it in most seeds ranks last).",
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
    if missing or args.seeds < 3 or any(not_run.values()):
        head += [f"**Partial board:** {args.seeds} seed(s); scenarios not run: {', '.join(missing) or 'none'}. "
                 "Regenerate with `python tools/benchmarks/leaderboard.py` (every scenario, 3 seeds)."]
        head += [f"Cells not run in {n}: {', '.join(compact(cells, n, args))}." for n, cells in not_run.items()
                 if cells and n not in missing]
        head += [""]
    tail = ["", "## Validation of the simulator", ""]
    if os.path.exists(validation):
        with open(validation) as f:
            tail.append(f.read())
    else:
        tail.append("Not run yet: `python tools/benchmarks/validate_clock.py` (on a quiet machine) compares every "
                    "algorithm's simulated time per step and ratio to the ceiling with the real emulated WAN "
                    "(tools/wan) and writes its table here.")
    return "\n".join(head + sections + tail)


def cell_flags(argv: List[str]) -> List[str]:
    """The flags a cell is known by: the scenario named by its file name and other paths
    relative to the checkout, so a cell is found from any clone and any cache directory (a
    free-link copy lives in the cache)."""
    return [os.path.basename(a) if i > 0 and argv[i - 1] == "--simulate-scenario" else a
            for i, a in enumerate(relative_flags(argv))]


def cell_digest(argv: List[str], scenario_path: str) -> str:
    """Of the flags and the scenario file's bytes."""
    with open(scenario_path, "rb") as f:
        return hashlib.sha256(" ".join(cell_flags(argv)).encode() + f.read()).hexdigest()[:12]


def compact(cells: List[str], name: str, args) -> List[str]:
    """The cells not run, a seed none of whose cells ran said once ("seed 2 (every cell)")."""
    every = board_cells(name, args)
    whole = [seed for seed in range(1, args.seeds + 1)
             if all(c in cells for c in every if c.endswith(f" seed {seed}"))]
    rest = [c for c in cells if not any(c.endswith(f" seed {seed}") for seed in whole)]
    return [f"seed {seed} (every cell)" for seed in whole] + rest


def board_cells(name: str, args) -> List[str]:
    """Every cell a scenario's table would hold with these arguments (labels x seeds)."""
    scenario = load_scenario(os.path.join(SCENARIO_DIR, f"{name}.toml"))
    algorithms = args.algorithms.split(",")
    labels = algorithms + [f"{a} ({FREE_LINK})" for a in algorithms if a in CEILING_ALGORITHMS
                           and has_slow_site(scenario)]
    return [f"{label} seed {seed}" for label in labels for seed in range(1, args.seeds + 1)]


def cached_cell(name: str, label: str, scenario_path: str, algo: str, seed: int, sites: int, args, steps: int,
                eval_interval: int, extra: Sequence[str] = ()) -> Optional[Dict]:
    """One cell, from the cache or trained now (None: not cached, and --cached-only). Its file name carries a digest of its flags and
    scenario file: a changed setting or cost model is a new cell, never a stale one reused."""
    argv = cell_argv(scenario_path, algo, seed, steps, eval_interval, sites,
                     settings_from=os.path.join(SCENARIO_DIR, f"{name}.toml"), extra=extra)
    digest = cell_digest(argv, scenario_path)
    tag = label.replace(" ", "_").replace("(", "").replace(")", "")
    cache = os.path.join(args.cache_dir, f"{name}__{tag}__seed{seed}__{digest}.json")

    def train() -> Optional[Dict]:
        if args.cached_only:
            return None
        print(f"> {name} / {label} / seed {seed} / {steps} steps{'' if eval_interval else ' (pilot)'}", flush=True)
        try:
            cell = run_cell(argv, sites)
        except Exception as err:  # a rank failed: its error line is above; the other cells go on
            print(f"error: cell {name} / {label} / seed {seed} failed ({err}); it is listed as not run", flush=True)
            return None
        cell["argv"], cell["steps"] = argv, steps
        return cell

    # the fingerprint of what the flags resolve to catches a cell that leaned on a default changed since
    return load_or_run(cache, train, fingerprint=resolved_fingerprint(cell_flags(argv)))


def scenario_cells(name: str, path: str, scenario, runs: List[Run], args, not_run: List[str]
                   ) -> Dict[str, List[Dict]]:
    """A scenario's cells by label. sync trains --steps steps; its training time is the budget.
    Every other algorithm first runs a pilot of --steps steps without evaluation (its pace on
    this scenario's clock, which neither the seed nor the data change), then, per seed, as many
    steps as fit in the budget at that pace (budget_steps), with its learning-rate schedule
    sized to them. A free-link ceiling trains the steps of the algorithm it is the ceiling of; a
    tuned variant has a pilot of its own (its settings change its pace)."""
    sites, steps = scenario.sites, args.steps
    sync = [cached_cell(name, "sync", path, "sync", seed, sites, args, steps, eval_interval_for(steps))
            for seed in range(1, args.seeds + 1)]
    # (every sync seed exists unless the board is written from the cache: then the seeds present)
    budget = statistics.median(c["seconds"] for c in sync if c) if any(sync) else None
    planned: Dict[Tuple[str, Tuple[str, ...]], Optional[int]] = {("sync", ()): steps}
    for run in runs:
        if run.plan in planned or run.scenario_path != path:
            continue
        pilot = cached_cell(name, f"{run.label} pilot", path, run.algorithm, 1, sites, args, steps, 0, run.extra)
        planned[run.plan] = None if pilot is None or budget is None else \
            budget_steps(steps, budget, pilot["seconds"], args.budget_cap)
    cells: Dict[str, List[Dict]] = {}
    for run in runs:
        for seed in range(1, args.seeds + 1):
            n = planned.get(run.plan)
            cell = None if n is None else sync[seed - 1] if run.label == "sync" else \
                cached_cell(name, run.label, run.scenario_path, run.algorithm, seed, sites, args, n,
                            eval_interval_for(n), run.extra)
            if cell is None:
                not_run.append(f"{run.label} seed {seed}")
            else:
                cells.setdefault(run.label, []).append(cell)
    return cells


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default=None, help="comma-separated scenario names (default: every file)")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=300,
                   help="sync's steps (its training time is every algorithm's budget) and each pilot's")
    p.add_argument("--budget-cap", type=int, default=3,
                   help="an algorithm faster than sync trains the steps that fit in sync's time, at most this "
                        "many times --steps")
    p.add_argument("--cache-dir", default=os.path.join(ROOT, "runs", "leaderboard"))
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "leaderboard.md"))
    p.add_argument("--plots-dir", default=os.path.join(ROOT, "docs", "leaderboard"))
    p.add_argument("--cached-only", action="store_true",
                   help="train nothing: write the board from the finished cells, listing the cells not run")
    p.add_argument("--measure-costs", action="store_true",
                   help="only measure this CPU's seconds per step of the leaderboard model and print them")
    args = p.parse_args()
    if args.measure_costs:
        print(f"CPU seconds per step (one micro-batch forward+backward and the optimizer step, one thread): "
              f"{measure_costs():.4f}")
        return
    names = args.scenarios.split(",") if args.scenarios else sorted(
        n[:-5] for n in os.listdir(SCENARIO_DIR) if n.endswith(".toml"))
    algorithms = args.algorithms.split(",")
    for a in algorithms:
        if a not in ALGORITHMS:
            p.error(f"--algorithms: {a!r} is not one of {', '.join(ALGORITHMS)}")
    os.makedirs(args.cache_dir, exist_ok=True)
    os.makedirs(args.plots_dir, exist_ok=True)
    sections = []
    board: Dict[str, Dict[str, List[Dict]]] = {}
    not_run: Dict[str, List[str]] = {}
    for name in names:
        path = os.path.join(SCENARIO_DIR, f"{name}.toml")
        if not os.path.exists(path):
            p.error(f"--scenarios: no {path}")
        scenario = load_scenario(path)
        runs = [Run(algo, algo, path) for algo in algorithms]
        runs += [Run(label, algo, path, flags) for label, algo, flags in VARIANTS.get(name, ()) if algo in algorithms]
        if has_slow_site(scenario):
            free = free_link_copy(path, args.cache_dir)
            runs += [Run(f"{algo} ({FREE_LINK})", algo, free) for algo in algorithms if algo in CEILING_ALGORITHMS]
        cells = scenario_cells(name, path, scenario, runs, args, not_run.setdefault(name, []))
        board[name] = cells
        if not cells:
            continue
        sections += summarize(name, scenario, cells) + ["", f"![{name}](leaderboard/{name}.png)", ""]
        reading = os.path.join(args.plots_dir, f"{name}.reading.md")  # written by whoever read the table
        if os.path.exists(reading):
            with open(reading) as f:
                sections += [f.read().strip(), ""]
        plot(name, cells, os.path.join(args.plots_dir, f"{name}.png"))
        print("\n".join(summarize(name, scenario, cells)), flush=True)
    targets_reading = os.path.join(args.plots_dir, "targets.reading.md")
    sections += ["## Open targets", "",
                 "Targets earlier rounds could not judge on the noisy real clock (issue 21, item 7), from the "
                 "cells above (median over seeds):", ""] + open_targets(board) + [""]
    if os.path.exists(targets_reading):
        with open(targets_reading) as f:
            sections += [f.read().strip(), ""]
    with open(args.out, "w") as f:
        f.write(document(names, sections, args, not_run) + "\n")
    print(f"wrote {args.out} and {args.plots_dir}/*.png")


if __name__ == "__main__":
    main()
