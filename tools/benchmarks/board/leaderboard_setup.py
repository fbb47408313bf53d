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


@dataclass(frozen=True)
class StandIn:
    """What every cell of a board trains: the GPT, its data, batch, learning rate and
    evaluations. The simulated clock charges the scenario's compute and bytes whatever it is
    (bytes scaled by its parameter count), so the stand-in sets the loss curves, and with
    them the target: sync's final validation loss after `steps` steps."""
    name: str
    model: Tuple[str, ...]
    micro_batch: int               # one micro-batch per replica per step
    steps: int                     # sync's steps (the budget) and each pilot's, by default
    lr: Tuple[str, ...]
    data: Tuple[str, ...]
    evaluation: Tuple[str, ...]    # each evaluation's flags (the cell adds --eval-interval)
    about: str                     # the board page's words for it
    files: Tuple[str, ...] = ()    # what training needs on disk that a clone lacks (none: bundled)
    prepare: str = ""              # the command that makes them

    @property
    def seq(self) -> int:
        return int(self.model[self.model.index("--seq-length") + 1])


# The board since its start: the bundled Python docs, 300 steps of sync from scratch (its final
# validation loss is early in training: 6.06 from 9.0).
TOY = StandIn("toy", tuple(MODEL), MICRO_BATCH, PILOT_STEPS, ("--lr", "2e-3", "--min-lr", "2e-4"), tuple(data_args()),
              ("--eval-iters", "1", "--full-validation"),
              f"the whole held-out split of the bundled corpus (`--split {SPLIT}` with `--full-validation`)")
# Issue 45's re-based board: the quality ladder's rung S (0.26M parameters, docs-corpus read once,
# sync trained to 20 tokens per parameter at 2 sites, its loss flat by the end of the schedule:
# docs/quality.md), the ladder's learning rate and held-out documents. Cells of the same
# scenario with either stand-in never share a cache file (the digest is of the flags).
DOCS_CORPUS_DIR = os.path.join(ROOT, "data", "docs-corpus")
DOCS_CORPUS = StandIn(
    "docs-corpus",
    ("--num-layers", "2", "--hidden-size", "48", "--num-attention-heads", "4", "--seq-length", "256",
     "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
     "--hidden-dropout", "0", "--attention-dropout", "0"),
    8, 1262, ("--lr", "3e-3", "--min-lr", "3e-4"),
    ("--train-data-path", os.path.join(DOCS_CORPUS_DIR, "docs_corpus_train_text_document"),
     "--valid-data-path", os.path.join(DOCS_CORPUS_DIR, "docs_corpus_valid_text_document"),
     "--tokenizer-type", "SentencePieceTokenizer",
     "--tokenizer-model", os.path.join(DOCS_CORPUS_DIR, "docs_corpus_sp4k.model")),
    ("--eval-iters", "40"),
    "the ladder's held-out documents of docs-corpus (40 batches: 163,840 tokens at 2 sites)",
    files=tuple(os.path.join(DOCS_CORPUS_DIR, f) for f in (
        "docs_corpus_train_text_document.bin", "docs_corpus_train_text_document.idx",
        "docs_corpus_valid_text_document.bin", "docs_corpus_valid_text_document.idx", "docs_corpus_sp4k.model")),
    prepare="python tools/prepare_corpus.py --input ../shared/data/docs-corpus.jsonl.gz --output-dir "
            "data/docs-corpus --name docs_corpus --vocab-size 4096 --workers 2")
STAND_INS = {s.name: s for s in (TOY, DOCS_CORPUS)}


def cell_ranks(scenario) -> int:
    """A cell's ranks: one per data-parallel replica (one per site unless the scenario's sites
    differ in size: replicas_per_site)."""
    return sum(scenario.replicas_per_site) if scenario.replicas_per_site else scenario.sites


def unequal_refusals(scenario, algorithms: Sequence[str]) -> Dict[str, str]:
    """{algorithm: why it does not run} on a scenario whose sites differ in size (the line
    pretrain_gpt.py would print); empty for equal sites."""
    return refusals("unequal_sites_refusal", list(algorithms)) if scenario.replicas_per_site else {}


def cell_argv(scenario_path: str, algorithm: str, seed: int, steps: int, eval_interval: int, sites: int,
              settings_from: Optional[str] = None, extra: Sequence[str] = (), stand_in: StandIn = TOY) -> List[str]:
    """The cell's flags; the recommended settings come from `settings_from` (a free-link
    ceiling keeps the settings of the scenario it is the ceiling of) or the scenario itself,
    and a tuned variant's `extra` flags follow them (the last of a flag given twice counts).
    `eval_interval` 0: no evaluation (a pilot, which only measures the pace). `stand_in`: what
    the cell trains (TOY's flags are the board's since its start, so its cached cells hold)."""
    scenario = load_scenario(scenario_path)
    replicas = scenario.replicas_per_site
    gbs = stand_in.micro_batch * cell_ranks(scenario)  # one micro-batch per replica per step
    layout = ["--site-data-parallel-sizes", ",".join(map(str, replicas))] if replicas else []
    evaluation = ["--eval-interval", str(eval_interval), *stand_in.evaluation] if eval_interval \
        else ["--eval-iters", "0"]
    argv = list(stand_in.model) + list(stand_in.data) + [
        "--micro-batch-size", str(stand_in.micro_batch), "--global-batch-size", str(gbs), *stand_in.lr,
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
