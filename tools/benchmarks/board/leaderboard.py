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
(validation loss vs simulated time, every algorithm); a run of a part of the board (some
scenarios, algorithms or fewer than 3 seeds) writes runs/leaderboard/leaderboard.md instead,
so the published tables are not replaced by a few cells.

    python -m tools.bench board  # everything (resumable)
    python -m tools.bench board --scenarios emulated-default --algorithms sync,diloco --seeds 1

In scenarios with a slow site, a-edit also runs on a copy of the scenario whose link is free
(same compute, same settings): its ceiling. A scenario may have tuned variants (a recipe's
`board_variants`: an algorithm with flags after its recommended ones, a row of its own with its own pilot),
where a target's miss asks what a user who knows the scenario would set. The board ends
with the open targets of earlier rounds (a-edit and acco under a slow site, cocodc vs
streaming-diloco, dreamddp vs diloco), judged from the cells.

`--stand-in docs-corpus` trains every cell on the quality ladder's rung S instead (issue 45:
docs-corpus, 1,262 steps of sync, a target from a trained model; docs/quality.md), onto its own
page, docs/leaderboard-docs-corpus.md, published from every algorithm at 3 seeds on whichever
scenarios were run.

A person's reading of a table goes in docs/leaderboard/<scenario>.reading.md (and
targets.reading.md), which the board includes under the table, so regenerating keeps it (its
relative links written from that directory; the board rebases them). The scenarios not run
link to the newest archived board (docs/leaderboard/archive-<date>.md), if there is one.

Finished cells are cached as JSON under --cache-dir, named by a digest of their flags and
scenario file, and reused; delete a file to re-run it (Ctrl-C stops every rank with one line:
the cell under way is lost, the finished ones are kept). The default, results/leaderboard/cells
(the measured data, outside docs/: the board and its plots are written into docs/), is
committed with the board: it is the data the tables are written from, so a clone regenerates
the board (--cached-only) and a later session adds seeds or scenarios to it instead of
training hours of cells again (a board of several hours outlives one session's machine).
--cached-only that finds no cell at all writes nothing. Each cell keeps every argument its flags
resolve to: a cell one of whose arguments resolves differently now (a default changed since)
is trained again; a flag added since is not compared (run_cache.py). A cell also records the
simulated clock's model version (`clock_model`, core/simulation.py's CLOCK_MODEL; none: model 1):
a cell of an older model is trained again, and --cached-only keeps it but its table says it was
made under the older model, so times of two models never mix unmarked. A change to an algorithm's
code is in neither: move its cells out of the cache to train them again. Each cell records the
commit it was trained at (`code`, "+changes" when the library differed from it: run_cache.py),
so `git diff <code> -- megatron_lsgd/core/lsgd/algorithms/acco.py` tells whether a cell predates a change.

Modules: recipes.py holds each algorithm's recommended settings, variants and ceiling (every
benchmark reads it), leaderboard_setup.py says what a cell trains (model, data, the recipes'
flags), this file trains and caches the cells, leaderboard_report.py judges them and writes
the board.

Recommended settings: the outer interval H of the DiLoCo family is chosen per scenario so
that one full-model exchange costs at most a tenth of H steps of compute,
H = clamp(ceil(10 x exchange / step), 5, 100), from the scenario's own cost and link model
(the exchange is bytes / rate + latency: a calibrated scenario's CPU per MB sent is left out;
counted, it would move emulated-straggler2x's H from 78 to 82 and emulated-1gbit-straggler4x's
from 12 to 14), rounded up to whole fragments (printed with the table); dilocox uses int4,
streaming-diloco/cocodc one fragment per layer with tau = min(5, H / 8), acco/dpu their
adaptive accumulation, at most recipes.MAX_MICROBATCHES per stage (acco from two micro-batches per
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
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)
CELLS_DIR = os.path.join(ROOT, "results", "leaderboard", "cells")  # the data; the board is a page in docs/
BOARD = os.path.join(ROOT, "docs", "leaderboard.md")
PARTIAL_BOARD = os.path.join(ROOT, "runs", "leaderboard", "leaderboard.md")  # (runs/ is not committed)


def board_pages(stand_in: str) -> Tuple[str, str]:
    """(the published page, a partial run's page) of a stand-in's board: the toy's are the
    board's since its start; another's have its name (docs/leaderboard-docs-corpus.md), and
    their plots and readings a folder of that name beside them."""
    if stand_in == "toy":
        return BOARD, PARTIAL_BOARD
    return (os.path.join(ROOT, "docs", f"leaderboard-{stand_in}.md"),
            os.path.join(ROOT, "runs", f"leaderboard-{stand_in}", f"leaderboard-{stand_in}.md"))

from megatron_lsgd.core.simulation import CLOCK_MODEL  # noqa: E402
from megatron_lsgd.training.initialize import free_port  # noqa: E402
from megatron_lsgd.training.scenario import load_scenario  # noqa: E402
from megatron_lsgd.core.output_files import write_json, write_text  # noqa: E402
from tools.benchmarks.tool_input import read_json_object  # noqa: E402
from tools.benchmarks.board.leaderboard_report import (clock_model_of, document, included, open_targets,  # noqa: E402
                                                 plot, summarize)
from tools.benchmarks.board.leaderboard_setup import (EVALUATIONS, MICRO_BATCH, MODEL, SCENARIO_DIR,  # noqa: E402
                                                      STAND_INS, TOY, Run, cell_argv, cell_ranks, data_args,
                                                      free_link_copy, has_slow_site, scenario_runs)
from tools.benchmarks.recipes import ALGORITHMS  # noqa: E402
from tools.benchmarks.run_cache import (SEEDS_HELP, load_or_run, positive_int, relative_flags,  # noqa: E402
                                        resolved_arguments, seed_list)
from tools.benchmarks.spawned_ranks import run_ranks, run_tool  # noqa: E402


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
                      comm=result.comm,  # exposed communication (tools/plan.py reads it)
                      stats=result.sync_stats)
    write_json(os.path.join(out_dir, f"{rank}.json"), record)
    shutdown_distributed()


def run_cell(argv: List[str], world: int) -> Dict:
    with tempfile.TemporaryDirectory() as d:
        run_ranks(_worker, (world, free_port(), argv, d), world)
        return cell_of(d, world)


def cell_of(folder: str, world: int) -> Dict:
    """A run's record from its ranks' files in `folder` (_worker's): the logging rank's, with
    the peak memory of every rank."""
    records = [json.load(open(os.path.join(folder, f"{r}.json"))) for r in range(world)]
    out = records[-1]
    out["peak_rss_mb"] = max(r["peak_rss_mb"] for r in records)
    return out


def _measure_worker(rank: int, ports: List[int], short: int, long: int, out_dir: str) -> None:
    """One site training MODEL alone (a one-rank world of its own, one thread), `short` then
    `long` steps after an unmeasured `short` one (the first run pays once for imports, data
    index and allocator: measured, it made the difference negative): the wall-clock and CPU
    seconds of each measured run."""
    import resource

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[rank]))
    torch.set_num_threads(1)
    import pretrain_gpt
    from megatron_lsgd.training.initialize import shutdown_distributed

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    spent = {}
    for iters in (short, short, long):  # the first is overwritten: a warm-up
        wall, used = time.perf_counter(), cpu()
        pretrain_gpt.main(MODEL + data_args() + ["--micro-batch-size", str(MICRO_BATCH), "--global-batch-size",
                                                 str(MICRO_BATCH), "--train-iters", str(iters), "--lr", "2e-3",
                                                 "--weight-decay", "0.1", "--clip-grad", "1.0",
                                                 "--log-interval", str(10 * long), "--eval-iters", "0"])
        spent[iters] = (time.perf_counter() - wall, cpu() - used)
        shutdown_distributed()
    write_json(os.path.join(out_dir, f"{rank}.json"), spent)


def measure_costs(sites: int, short: int = 10, long: int = 50) -> Tuple[float, float]:
    """Seconds per step of MODEL as a leaderboard cell trains it on this machine: `sites` sites
    at once, each one rank with one thread (forward+backward of one micro-batch and the
    optimizer step), each training alone so no communication enters. Returns (wall-clock,
    CPU) seconds per step, each the difference of a `long` and a `short` run over the extra
    steps (start-up drops out), the median over the sites. The wall-clock figure is the
    compute cost: sites sharing the cores and the machine's other load take time that CPU
    seconds do not count (2026-11: CPU seconds came out about 38% below the wall-clock step)."""
    with tempfile.TemporaryDirectory() as d:
        run_ranks(_measure_worker, ([free_port() for _ in range(sites)], short, long, d), sites)
        spent = [json.load(open(os.path.join(d, f"{r}.json"))) for r in range(sites)]
    per_step = [[(s[str(long)][i] - s[str(short)][i]) / (long - short) for s in spent] for i in (0, 1)]
    return statistics.median(per_step[0]), statistics.median(per_step[1])


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


def cached_cell(name: str, label: str, scenario_path: str, algo: str, seed: int, sites: int, args, steps: int,
                eval_interval: int, extra: Sequence[str] = (), progress: str = "") -> Optional[Dict]:
    """One cell, from the cache or trained now (None: not cached, and --cached-only). Its file name carries a digest of its flags and
    scenario file: a changed setting or cost model is a new cell, never a stale one reused.
    `progress` ("cell 3 of 39", say) goes in the line that announces a cell trained now."""
    argv = cell_argv(scenario_path, algo, seed, steps, eval_interval, sites,
                     settings_from=os.path.join(SCENARIO_DIR, f"{name}.toml"), extra=extra,
                     stand_in=getattr(args, "stand_in_obj", TOY))
    digest = cell_digest(argv, scenario_path)
    tag = label.replace(" ", "_").replace("(", "").replace(")", "")
    cache = os.path.join(args.cache_dir, f"{name}__{tag}__seed{seed}__{digest}.json")

    def train() -> Optional[Dict]:
        if args.cached_only:
            return None
        print(f"> [{time.strftime('%H:%M:%S')}] {name} / {label} / seed {seed} / {steps} steps"
              f"{'' if eval_interval else ' (pilot)'}{f' ({progress})' if progress else ''}", flush=True)
        start = time.monotonic()
        try:
            cell = run_cell(argv, cell_ranks(load_scenario(scenario_path)))  # one rank per replica
        except Exception as err:  # a rank failed: its error line is above; the other cells go on
            print(f"error: cell {name} / {label} / seed {seed} failed ({err}); it is listed as not run", flush=True)
            return None
        # what the cell cost this machine (real time, not the simulated seconds it reports): a board's price
        cell["argv"], cell["steps"], cell["real_seconds"] = argv, steps, round(time.monotonic() - start, 1)
        cell["clock_model"] = CLOCK_MODEL  # its simulated times are of this model (core/simulation.py)
        print(f"> {name} / {label} / seed {seed}: trained in {cell['real_seconds']:.0f} s of real time", flush=True)
        return cell

    # a cell of an older clock model is trained again; --cached-only keeps it, and the board says so
    older = older_clock_model(cache)
    if older is not None and not args.cached_only:
        print(f"  {os.path.basename(cache)} was made under clock model {older}, not {CLOCK_MODEL}: trained again",
              flush=True)
    # what the flags resolve to catches a cell that leaned on a default changed since
    return load_or_run(cache, train, refresh=older is not None and not args.cached_only,
                       resolved=resolved_arguments(cell_flags(argv)))


def older_clock_model(cache: str) -> Optional[int]:
    """The clock model of the cell cached at `cache` when it is not the current one, else None."""
    if not os.path.exists(cache):
        return None
    model = clock_model_of(read_json_object(cache, "cached result", "delete it to compute the run again"))
    return model if model != CLOCK_MODEL else None


def scenario_cells(name: str, path: str, scenario, runs: List[Run], args, not_run: List[str],
                   spent: Optional[List[Optional[float]]] = None) -> Dict[str, List[Dict]]:
    """A scenario's cells by label. sync trains --steps steps; its training time is the budget.
    Every other algorithm first runs a pilot of --steps steps without evaluation (its pace on
    this scenario's clock, which neither the seed nor the data change), then, per seed, as many
    steps as fit in the budget at that pace (budget_steps), with its learning-rate schedule
    sized to them. A free-link ceiling trains the steps of the algorithm it is the ceiling of; a
    tuned variant has a pilot of its own (its settings change its pace). `spent` collects the
    real seconds each cell and pilot took to train (None for a cell that did not keep them)."""
    sites, steps = scenario.sites, args.steps
    # for the line announcing a cell: sync's seeds, the pilots, every other row's seeds
    others = [run for run in runs if run.label != "sync"]
    total = len(args.seeds) * (1 + len(others)) + len({run.plan for run in others if run.scenario_path == path})
    done = [0]

    def progress() -> str:
        done[0] += 1
        return f"cell {done[0]} of {total} in this scenario, cached ones included"

    sync = {seed: cached_cell(name, "sync", path, "sync", seed, sites, args, steps, eval_interval_for(steps),
                              progress=progress())
            for seed in args.seeds}
    # (every sync seed exists unless the board is written from the cache: then the seeds present)
    budget = statistics.median(c["seconds"] for c in sync.values() if c) if any(sync.values()) else None
    trained = list(sync.values())
    planned: Dict[Tuple[str, Tuple[str, ...]], Optional[int]] = {("sync", ()): steps}
    for run in runs:
        if run.plan in planned or run.scenario_path != path:
            continue
        pilot = cached_cell(name, f"{run.label} pilot", path, run.algorithm, 1, sites, args, steps, 0, run.extra,
                            progress())
        trained.append(pilot)
        planned[run.plan] = None if pilot is None or budget is None else \
            budget_steps(steps, budget, pilot["seconds"], args.budget_cap)
    cells: Dict[str, List[Dict]] = {}
    for run in runs:
        for seed in args.seeds:
            n = planned.get(run.plan)
            at = "" if run.label == "sync" else progress()  # (sync's were counted above)
            cell = None if n is None else sync[seed] if run.label == "sync" else \
                cached_cell(name, run.label, run.scenario_path, run.algorithm, seed, sites, args, n,
                            eval_interval_for(n), run.extra, at)
            if cell is None:
                not_run.append(f"{run.label} seed {seed}")
            else:
                cells.setdefault(run.label, []).append(cell)
                if run.label != "sync":
                    trained.append(cell)
    if spent is not None:
        spent += [c.get("real_seconds") for c in trained if c]
    return cells


def scenario_rows(name: str, path: str, scenario, algorithms: Sequence[str], cache_dir: str) -> List[Run]:
    """leaderboard_setup.scenario_runs, with a slow site's free-link copy written under cache_dir."""
    free = free_link_copy(path, cache_dir) if has_slow_site(scenario) else ""
    return scenario_runs(name, path, scenario, algorithms, free)


def every_scenario() -> List[str]:
    return sorted(n[:-5] for n in os.listdir(SCENARIO_DIR) if n.endswith(".toml"))


def default_board(names: Sequence[str], algorithms: Sequence[str], seeds: Sequence[int], stand_in: str = "toy") -> str:
    """docs/leaderboard.md for the whole board (every scenario and algorithm, 3 seeds or more),
    else PARTIAL_BOARD: a run of a few cells does not replace the published tables. Another
    stand-in's page is published from every algorithm at 3 seeds or more on any scenarios (it
    names them: a board of hours a scenario need not hold them all)."""
    published, partial = board_pages(stand_in)
    every = sorted(algorithms) == sorted(ALGORITHMS) and len(seeds) >= 3
    whole = every and (stand_in != "toy" or sorted(names) == every_scenario())
    return published if whole else partial


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default=None, help="comma-separated scenario names (default: every file)")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS))
    p.add_argument("--seeds", type=seed_list, default=seed_list("3"), help=SEEDS_HELP)
    p.add_argument("--stand-in", choices=sorted(STAND_INS), default="toy",
                   help="what every cell trains: toy, the board since its start (the bundled Python docs, a "
                        "1.5M-parameter GPT, 300 steps: a target early in training); docs-corpus, issue 45's re-based "
                        "board (the quality ladder's rung S on docs-corpus, 1,262 steps: 20 tokens per parameter, "
                        "the loss flat at the end; needs data/docs-corpus, docs/quality.md; its page "
                        "docs/leaderboard-docs-corpus.md)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="sync's steps (its training time is every algorithm's budget) and each pilot's (default: "
                        "the stand-in's, 300 toy, 1262 docs-corpus)")
    p.add_argument("--budget-cap", type=positive_int, default=3,
                   help="an algorithm faster than sync trains the steps that fit in sync's time, at most this "
                        "many times --steps")
    p.add_argument("--cache-dir", default=CELLS_DIR,
                   help="finished cells (default: results/leaderboard/cells, committed with the board it writes)")
    p.add_argument("--out", default=None,
                   help="the board (default: docs/leaderboard.md for the whole board, every scenario and algorithm "
                        "with 3 seeds or more; runs/leaderboard/leaderboard.md for a part of it)")
    p.add_argument("--plots-dir", default=None,
                   help="its plots, and the readings it includes (default: leaderboard/ beside --out)")
    p.add_argument("--cached-only", action="store_true",
                   help="train nothing: write the board from the finished cells, listing the cells not run")
    p.add_argument("--measure-costs", type=positive_int, nargs="?", const=2, default=None, metavar="SITES",
                   help="only measure the wall-clock seconds per step of the leaderboard model as a cell trains it "
                        "on this machine, SITES sites at once (default 2: the emulated scenarios), and print them "
                        "(run it on a quiet machine)")
    args = p.parse_args()
    if args.measure_costs:
        wall, cpu = measure_costs(args.measure_costs)
        print(f"seconds per step of the leaderboard model (one micro-batch forward+backward and the optimizer step), "
              f"{args.measure_costs} site(s) training at once, one rank and one thread each, median over the sites: "
              f"{wall:.4f} wall-clock (the compute cost a scenario takes), {cpu:.4f} CPU")
        return
    args.stand_in_obj = STAND_INS[args.stand_in]
    args.steps = args.steps or args.stand_in_obj.steps
    missing = [f for f in args.stand_in_obj.files if not os.path.exists(f)]
    if missing and not args.cached_only:
        p.error(f"--stand-in {args.stand_in}: {os.path.relpath(missing[0], ROOT)} is missing; prepare the corpus "
                f"first: {args.stand_in_obj.prepare}")
    names = args.scenarios.split(",") if args.scenarios else every_scenario()
    algorithms = args.algorithms.split(",")
    for a in algorithms:
        if a not in ALGORITHMS:
            p.error(f"--algorithms: {a!r} is not one of {', '.join(ALGORITHMS)}")
    if args.out is None:
        args.out = default_board(names, algorithms, args.seeds, args.stand_in)
        published, partial = board_pages(args.stand_in)
        if args.out == partial:  # the published board is not replaced by a part of it
            print(f"> a part of the board (--scenarios, --algorithms or --seeds): written to "
                  f"{os.path.relpath(args.out, ROOT)}, not {os.path.relpath(published, ROOT)} (name --out to choose)",
                  flush=True)
    if args.plots_dir is None:
        args.plots_dir = os.path.join(os.path.dirname(args.out),
                                      "leaderboard" if args.stand_in == "toy" else f"leaderboard-{args.stand_in}")
    os.makedirs(args.cache_dir, exist_ok=True)
    os.makedirs(args.plots_dir, exist_ok=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    sections = []
    board: Dict[str, Dict[str, List[Dict]]] = {}
    not_run: Dict[str, List[str]] = {}
    spent: Dict[str, List[Optional[float]]] = {}
    for name in names:
        path = os.path.join(SCENARIO_DIR, f"{name}.toml")
        if not os.path.exists(path):
            p.error(f"--scenarios: no {path}")
        scenario = load_scenario(path)
        runs = scenario_rows(name, path, scenario, algorithms, args.cache_dir)
        cells = scenario_cells(name, path, scenario, runs, args, not_run.setdefault(name, []),
                               spent.setdefault(name, []))
        board[name] = cells
        if not cells:
            continue
        png = os.path.join(args.plots_dir, f"{name}.png")
        link = os.path.relpath(png, os.path.dirname(os.path.abspath(args.out)))
        sections += summarize(name, scenario, cells) + ["", f"![{name}]({link})", ""]
        reading = os.path.join(args.plots_dir, f"{name}.reading.md")  # written by whoever read the table
        if os.path.exists(reading):
            sections += [included(reading, args.out), ""]
        plot(name, cells, png)
        print("\n".join(summarize(name, scenario, cells)), flush=True)
    if args.cached_only and not any(board.values()):
        p.error(f"--cached-only: no finished cell under {args.cache_dir} for these scenarios; {args.out} is left "
                f"as it is (an empty board would replace its tables)")
    targets_reading = os.path.join(args.plots_dir, "targets.reading.md")
    sections += ["## Open targets", "",
                 "Targets earlier rounds could not judge on the noisy real clock (issue 21, item 7), from the "
                 "cells above (median over seeds):", ""] + open_targets(board) + [""]
    if os.path.exists(targets_reading):
        sections += [included(targets_reading, args.out), ""]
    write_text(args.out, document(names, sections, args, not_run, spent) + "\n")
    print(f"wrote {args.out} and {args.plots_dir}/*.png")


if __name__ == "__main__":
    run_tool(main, "finished cells are kept; the same command resumes after them")

