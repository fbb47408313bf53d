"""What a leaderboard cell trains (tools/benchmarks/board/leaderboard.py runs the cells): the small
GPT and the bundled corpus, each algorithm's recommended settings for a scenario and the tuned
variants and free-link ceilings a scenario adds (from tools/benchmarks/recipes.py), and the
list of a board's cells."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_lsgd.core.lsgd.catalog import refusals, synchronizer_class
from megatron_lsgd.training.scenario import load_scenario
from megatron_lsgd.core.output_files import write_text
from tools.benchmarks.recipes import LAYERS, board_variants, recipe, recommended

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SCENARIO_DIR = os.path.join(ROOT, "tools", "benchmarks", "scenarios")
DATA = os.path.join(ROOT, "data", "python-docs")

# The small GPT every cell trains (its parameter count sets the bytes a step exchanges).
SEQ = 64
MODEL = ["--num-layers", str(LAYERS), "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", str(SEQ),
         "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
         "--hidden-dropout", "0", "--attention-dropout", "0"]
MICRO_BATCH = 4
# sync's steps (its training time is every algorithm's budget) and each pilot's, by default:
# tools/plan.py's round-based pilots run as many, so that their paces are the board's.
PILOT_STEPS = 300


# The held-out split every evaluation covers in full (--full-validation): about 2% of the
# corpus, the same samples in every evaluation of every cell, so that curves and seeds compare.
SPLIT = "979,20,1"
# Evaluations per run (the interval scales with the run's length).
EVALUATIONS = 12


def data_args() -> List[str]:
    return ["--data-path", os.path.join(DATA, "python_docs_text_document"), "--split", SPLIT,
            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", os.path.join(DATA, "python_docs_sp8k.model")]


def cell_ranks(scenario) -> int:
    """A cell's ranks: one per data-parallel replica (one per site unless the scenario's sites
    differ in size: replicas_per_site)."""
    return sum(scenario.replicas_per_site) if scenario.replicas_per_site else scenario.sites


def unequal_refusals(scenario, algorithms: Sequence[str]) -> Dict[str, str]:
    """{algorithm: why it does not run} on a scenario whose sites differ in size (the line
    pretrain_gpt.py would print); empty for equal sites."""
    return refusals("unequal_sites_refusal", list(algorithms)) if scenario.replicas_per_site else {}


def cell_argv(scenario_path: str, algorithm: str, seed: int, steps: int, eval_interval: int, sites: int,
              settings_from: Optional[str] = None, extra: Sequence[str] = ()) -> List[str]:
    """The cell's flags; the recommended settings come from `settings_from` (a free-link
    ceiling keeps the settings of the scenario it is the ceiling of) or the scenario itself,
    and a tuned variant's `extra` flags follow them (the last of a flag given twice counts).
    `eval_interval` 0: no evaluation (a pilot, which only measures the pace)."""
    scenario = load_scenario(scenario_path)
    replicas = scenario.replicas_per_site
    gbs = MICRO_BATCH * cell_ranks(scenario)  # one micro-batch per replica per step
    layout = ["--site-data-parallel-sizes", ",".join(map(str, replicas))] if replicas else []
    evaluation = ["--eval-interval", str(eval_interval), "--eval-iters", "1", "--full-validation"] if eval_interval \
        else ["--eval-iters", "0"]
    argv = MODEL + data_args() + [
        "--micro-batch-size", str(MICRO_BATCH), "--global-batch-size", str(gbs), "--lr", "2e-3", "--min-lr", "2e-4",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", str(max(1, steps // 20)), "--weight-decay", "0.1",
        "--clip-grad", "1.0", "--seed", str(seed), "--num-sites", str(sites), "--log-interval", str(steps),
        *layout, *evaluation, "--simulate-scenario", scenario_path, "--lsgd-algorithm", algorithm]
    argv += recommended(algorithm, load_scenario(settings_from or scenario_path)) + list(extra)
    if synchronizer_class(algorithm).lockstep:
        argv += ["--train-iters", str(steps)]
    else:  # sites take different numbers of steps: the same budget in samples
        argv += ["--train-samples", str(steps * gbs)]
    return argv


FREE_LINK = "free link"  # the label of a row on a free-link copy of its scenario (a recipe's `free_link`)


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
             f"sites = {data['sites']}"]
    lines += [f"replicas_per_site = {json.dumps(data['replicas_per_site'])}"] if "replicas_per_site" in data else []
    lines += ["", "[compute]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in data.get("compute", {}).items()]
    lines += ["", "[link]", "rate_mbit = 0", "latency_ms = 0"]
    link = data.get("link", {})
    lines += [f"{k} = {json.dumps(link[k])}" for k in ("bytes_scale", "target_params") if k in link]
    out = os.path.join(out_dir, f"{name}.free-link.toml")
    write_text(out, "\n".join(lines) + "\n")
    return out


def has_slow_site(scenario) -> bool:
    return any(f != scenario.site_factors[0] for f in scenario.site_factors)


def compact(cells: List[str], name: str, args) -> List[str]:
    """The cells not run, a seed none of whose cells ran said once ("seed 2 (every cell)")."""
    every = board_cells(name, args)
    whole = [seed for seed in args.seeds
             if all(c in cells for c in every if c.endswith(f" seed {seed}"))]
    rest = [c for c in cells if not any(c.endswith(f" seed {seed}") for seed in whole)]
    return [f"seed {seed} (every cell)" for seed in whole] + rest


def scenario_runs(name: str, path: str, scenario, algorithms: Sequence[str], free_path: str) -> List[Run]:
    """A scenario's rows: every algorithm, the scenario's tuned variants, and with a slow site
    the free-link ceilings, on the scenario file at free_path (free_link_copy's)."""
    refused = unequal_refusals(scenario, algorithms)
    algorithms = [a for a in algorithms if a not in refused]
    runs = [Run(algo, algo, path) for algo in algorithms]
    runs += [Run(label, algo, path, flags) for label, algo, flags in board_variants(name) if algo in algorithms]
    if has_slow_site(scenario):
        runs += [Run(f"{algo} ({FREE_LINK})", algo, free_path) for algo in algorithms if recipe(algo).free_link]
    return runs


def board_cells(name: str, args) -> List[str]:
    """Every cell a scenario's table would hold with these arguments (rows x seeds)."""
    path = os.path.join(SCENARIO_DIR, f"{name}.toml")
    runs = scenario_runs(name, path, load_scenario(path), args.algorithms.split(","), free_path="")
    return [f"{run.label} seed {seed}" for run in runs for seed in args.seeds]
