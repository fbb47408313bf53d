"""tools/benchmarks/recipes.py, without training: every algorithm has a recipe for every tool and
scenario, and the flags the recipes build do not drift. A run is cached under a digest of its
flags (run_cache.py): a flag that changes or moves trains every run of it again and leaves the
committed ones unread, so a drift must fail here, loudly, not show up as hours of retraining."""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import pytest

from megatron_lsgd.core.lsgd.catalog import registered_algorithms, synchronizer_class
from megatron_lsgd.training.arguments import build_config, parse_args
from megatron_lsgd.training.scenario import load_scenario
from tools.benchmarks.board import leaderboard as lb
from tools.benchmarks.board import leaderboard_setup as lb_setup
from tools.benchmarks.quality import lsgd_quality
from tools.benchmarks.quality import quality_frontier as qf
from tools.benchmarks import recipes

SCENARIOS = lb.every_scenario()
KNOBS = lsgd_quality.parser().parse_args([])  # lsgd_quality.py's defaults
TINY = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "4", "--global-batch-size", "16", "--train-iters", "100", "--lr", "1e-3",
        "--mock-data", "--vocab-size", "512", "--num-sites", "2"]


def scenario(name: str):
    return load_scenario(os.path.join(lb_setup.SCENARIO_DIR, f"{name}.toml"))


def shipped_algorithms():
    """The package's own algorithms (other tests register test synchronizers in the catalog)."""
    return [a for a in registered_algorithms()
            if synchronizer_class(a).__module__.startswith("megatron_lsgd.core.lsgd.algorithms")]


def test_every_algorithm_in_the_catalog_has_a_recipe_for_every_scenario():
    assert sorted(recipes.RECIPES) == sorted(shipped_algorithms()) and len(shipped_algorithms()) == 10
    for name in SCENARIOS:
        s = scenario(name)
        refused = lb_setup.unequal_refusals(s, recipes.ALGORITHMS)  # (sites of different sizes)
        for algorithm in recipes.ALGORITHMS:
            flags = recipes.recommended(algorithm, s)
            assert all(isinstance(f, str) for f in flags), (name, algorithm)
            argv = lb_setup.cell_argv(s.path, algorithm, 1, 100, 25, s.sites)
            if algorithm in refused:  # the board leaves it out, as the training would refuse it
                with pytest.raises(ValueError, match=f"{algorithm}: "):
                    build_config(parse_args(argv), lb_setup.cell_ranks(s))
                continue
            build_config(parse_args(argv), lb_setup.cell_ranks(s))  # the training's own checks
    # each default and variant (at H = 48: the tool's default H = 50 does not cut into its 4 fragments)
    for label, flags in recipes.quality_runs(lsgd_quality.parser().parse_args(["--interval", "48"])).items():
        build_config(parse_args(TINY + flags), 2)
    assert {a for a in recipes.ALGORITHMS} <= set(recipes.quality_runs(KNOBS))  # a default each
    for algorithm, r in recipes.RECIPES.items():  # tuned rows name a scenario file that exists
        assert set(r.board_variants) <= set(SCENARIOS), algorithm


def test_an_algorithm_without_a_recipe_is_an_error_naming_the_table():
    with pytest.raises(ValueError, match="'new-algo' has no recipe: add one to tools/benchmarks/recipes.py"):
        recipes.recommended("new-algo", scenario("emulated-default"))


def test_a_few_runs_keep_their_flags_to_the_letter():
    assert recipes.recommended("streaming-diloco", scenario("emulated-straggler2x")) == [
        "--lsgd-interval", "78", "--lsgd-outer-lr", "1.0", "--lsgd-outer-momentum", "0.0", "--lsgd-fragments", "2",
        "--lsgd-fragment-sync-delay", "5"]
    assert recipes.recommended("a-edit", scenario("emulated-1gbit-straggler4x")) == [
        "--lsgd-aedit-interval-seconds", "0.696", "--lsgd-outer-lr", "1.0", "--lsgd-outer-momentum", "0.0"]
    assert recipes.recommended("acco", scenario("3site-1gbit-straggler")) == [
        "--lsgd-site-microbatches", "2,2,2", "--lsgd-max-microbatches", "4"]
    # a whole leaderboard cell, as its cache file's digest reads it
    assert lb.cell_flags(lb_setup.cell_argv(scenario("emulated-default").path, "diloco", 1, 300, 25, 2)) == [
        "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "64",
        "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
        "--hidden-dropout", "0", "--attention-dropout", "0",
        "--data-path", "data/python-docs/python_docs_text_document", "--split", "979,20,1",
        "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "data/python-docs/python_docs_sp8k.model",
        "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "2e-3", "--min-lr", "2e-4",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", "15", "--weight-decay", "0.1", "--clip-grad", "1.0",
        "--seed", "1", "--num-sites", "2", "--log-interval", "300", "--eval-interval", "25", "--eval-iters", "1",
        "--full-validation", "--simulate-scenario", "emulated-default.toml", "--lsgd-algorithm", "diloco",
        "--lsgd-interval", "100", "--lsgd-outer-lr", "1.0", "--lsgd-outer-momentum", "0.0", "--train-iters", "300"]
    runs = recipes.quality_runs(KNOBS)
    assert runs["dilocox-lowrank-int4"] == [
        "--lsgd-algorithm", "dilocox", "--lsgd-compression", "lowrank-int4", "--lsgd-rank", "8",
        "--lsgd-interval", "50", "--lsgd-outer-lr", "0.7", "--lsgd-outer-momentum", "0.5",
        "--lsgd-dilocox-restart", "eager", "--lsgd-dilocox-apply-step", "0"]
    assert runs["cocodc"] == [
        "--lsgd-algorithm", "cocodc", "--lsgd-cocodc-lambda", "0.5", "--lsgd-cocodc-gamma", "0.4",
        "--lsgd-cocodc-syncs-per-round", "0", "--lsgd-interval", "50", "--lsgd-outer-lr", "0.7",
        "--lsgd-outer-momentum", "0.9", "--lsgd-fragments", "4", "--lsgd-fragment-partition", "strided",
        "--lsgd-fragment-sync-delay", "5"]
    assert runs["edit-nopenalty-fault"] == [
        "--lsgd-algorithm", "edit", "--lsgd-edit-penalty", "none", "--lsgd-edit-inject-fault", "1:8:100",
        "--lsgd-interval", "50", "--lsgd-outer-lr", "0.7", "--lsgd-outer-momentum", "0.9"]
    points = {p.label: p.flags for p in qf.default_points(50, 4)}
    assert points["cocodc-l0.5-mean-square"] == [
        "--lsgd-algorithm", "cocodc", "--lsgd-cocodc-lambda", "0.5", "--lsgd-cocodc-dc-normalize", "mean-square",
        "--lsgd-cocodc-syncs-per-round", "2", "--lsgd-interval", "50", "--lsgd-fragments", "2",
        "--lsgd-fragment-sync-delay", "5"]
    assert points["sparseloco-d0.0156"] == [
        "--lsgd-algorithm", "diloco", "--lsgd-interval", "50", "--lsgd-outer-lr", "1.0", "--lsgd-outer-momentum", "0",
        "--lsgd-compression", "topk-2bit", "--lsgd-topk-density", "0.015625", "--lsgd-ef-decay", "0.95"]
    assert points["a-edit-tau50"] == [
        "--lsgd-algorithm", "a-edit", "--simulate-clock", "--simulate-microbatch-seconds", "0",
        "--simulate-optimizer-step-seconds", "1", "--lsgd-aedit-interval-seconds", "50"]
    # the ladder's order is its pages' (and their JSON's)
    assert [p.label for p in qf.ladder_points()] == [
        "diloco-H30-avg", "diloco-H30-nesterov-lr0.1", "diloco-H30-nesterov-lr0.2", "diloco-H30-nesterov-lr0.4",
        "diloco-H30-nesterov-lr0.7", "diloco-H30-nesterov-lr1.0", "diloco-H100-avg", "diloco-H100-nesterov-lr0.1",
        "diloco-H100-nesterov-lr0.2", "diloco-H100-nesterov-lr0.4", "diloco-H100-nesterov-lr0.7",
        "diloco-H100-nesterov-lr1.0", "streaming-diloco-H30", "dilocox-H30"]


def everything(r: recipes.Recipe) -> str:
    """A recipe's flags in every tool: lsgd_quality's runs, every scenario's settings and tuned
    rows, the frontier at several H and depths, the ladder and the claims."""
    return json.dumps({
        "quality": {"default": r.default(KNOBS), **r.variants(KNOBS)},
        "recommended": {name: r.recommended(scenario(name), recipes.recommended_interval(scenario(name)))
                        for name in FROZEN_SCENARIOS},
        "board": r.board_variants, "free_link": r.free_link,
        "frontier": [[[p.label, p.family, p.flags] for p in r.frontier(h, n)] for h in (7, 30, 48, 50, 200)
                     for n in (1, 2, 4, 6)],
        "ladder": [[p.label, p.family, p.flags] for p in r.ladder(qf.LADDER_OUTER_LRS)],
        "claims": [[p.label, p.family, p.flags] for p in r.claims()]})


# The scenarios whose settings the digests below cover: those with committed board cells when they
# were frozen (a scenario added since changes no committed run; add it here with its cells).
FROZEN_SCENARIOS = ("2x8gpu-1gbit-1b", "3site-1gbit-straggler", "4site-10gbit-8b", "8site-internet-150m",
                    "emulated-1gbit-straggler4x", "emulated-default", "emulated-straggler2x")
# sha256 of everything(recipe)[:16], per algorithm. A digest that changes means that algorithm's
# committed runs stop being read: if that is what you want, retrain them and update it here.
FROZEN = {
    "sync": "b045501de8fc7725", "diloco": "37d8b938bc49b555", "dilocox": "ec733942e58b03a6",
    "streaming-diloco": "ad9966908e369cfc", "cocodc": "e315f23b4501ea88", "dreamddp": "71b4ad47ce757832",
    "dpu": "5106aa7e26ca5d60", "acco": "e743a307e1b28bfa", "edit": "1e82ca1246ca145b", "a-edit": "59763a6d52a6d138",
}


@pytest.mark.parametrize("algorithm", recipes.ALGORITHMS)
def test_every_recipe_s_flags_are_frozen(algorithm):
    digest = hashlib.sha256(everything(recipes.RECIPES[algorithm]).encode()).hexdigest()[:16]
    assert algorithm in FROZEN, f"a new recipe: freeze its flags, {algorithm!r}: {digest!r} in FROZEN"
    assert digest == FROZEN[algorithm], f"the flags of {algorithm}'s recipe changed (see FROZEN)"


def test_the_committed_board_cells_are_found_under_the_recipes_flags(tmp_path):
    """The leaderboard's committed cells (results/leaderboard/cells), pilots included, are hits:
    every row that has a cell there has all of them at seeds 1-3. A row with none (a new
    algorithm, scenario or variant, not trained yet) is not asked for."""
    args = argparse.Namespace(cache_dir=lb.CELLS_DIR, cached_only=True, steps=lb_setup.PILOT_STEPS, budget_cap=3,
                              seeds=[1, 2, 3])
    cells = os.listdir(lb.CELLS_DIR)
    checked = 0
    for name in SCENARIOS:
        s = scenario(name)
        free = lb_setup.free_link_copy(s.path, str(tmp_path)) if lb_setup.has_slow_site(s) else ""
        runs = lb_setup.scenario_runs(name, s.path, s, recipes.ALGORITHMS, free)
        not_run: list = []
        lb.scenario_cells(name, s.path, s, runs, args, not_run)
        for run in runs:
            tag = run.label.replace(" ", "_").replace("(", "").replace(")", "")
            if any(c.startswith(f"{name}__{tag}__") for c in cells):
                missing = [c for c in not_run if c.rsplit(" seed ", 1)[0] == run.label]
                assert not missing, f"{name}: {missing} not found under the recipes' flags"
                checked += 1
    assert checked >= len(FROZEN_SCENARIOS) * len(recipes.ALGORITHMS)  # the committed board: every row
