"""tools/benchmarks/board/leaderboard.py without training: the recommended interval from a
scenario's cost and link model (hand-computed), time to a target between evaluations, the
loss at a budget, the ranking, and which budget flag each algorithm gets."""

import argparse
import os

import pytest

from megatron_lsgd.training.scenario import load_scenario
from tools.benchmarks.board import leaderboard as lb
from tools.benchmarks.board import leaderboard_report as lb_report
from tools.benchmarks.board import leaderboard_setup as lb_setup
from tools.benchmarks import recipes
from tools.benchmarks import run_cache

EMULATED = os.path.join(lb_setup.SCENARIO_DIR, "emulated-default.toml")


def test_recommended_interval_hides_an_exchange_in_a_tenth_of_h_steps(tmp_path):
    line = tmp_path / "line.toml"  # 0.041 + 0.017 s per step, 100 Mbit/s, 20 ms, bytes x 1
    line.write_text("sites = 2\n[compute]\nmicrobatch_seconds = 0.041\noptimizer_step_seconds = 0.017\n"
                    "[link]\nrate_mbit = 100\nlatency_ms = 20\nbytes_scale = 1.0\n")
    exchange = 4 * recipes.TRAINED_PARAMS_GUESS * 2 * (2 - 1) / 2 * 8 / 100e6 + 0.020
    h = int(-(-10 * exchange // 0.058))
    assert h < 100 and recipes.recommended_interval(load_scenario(str(line))) == -(-h // recipes.LAYERS) * recipes.LAYERS
    assert recipes.recommended_interval(load_scenario(EMULATED)) == 100  # 64 Mbit/s for an all-reduce: capped
    odd = load_scenario(os.path.join(lb_setup.SCENARIO_DIR, "emulated-straggler2x.toml"))
    assert recipes.recommended_interval(odd) % recipes.LAYERS == 0
    fast = load_scenario(os.path.join(lb_setup.SCENARIO_DIR, "2x8gpu-1gbit-1b.toml"))
    assert recipes.recommended_interval(fast) == 100  # a 1B model over 1 Gbit/s: capped


def cell(seconds, losses, total, iterations=10, samples=80):
    return {"valid_seconds": seconds, "valid": losses, "seconds": total, "iterations": iterations,
            "samples": samples, "traffic": {"bytes": 2 ** 20}, "peak_rss_mb": 100.0}


def test_time_to_target_interpolates_and_loss_at_budget_takes_the_last_seen():
    c = cell([10.0, 20.0, 30.0], [6.0, 5.0, 4.0], 30.0)
    assert lb_report.time_to(c, 4.5) == pytest.approx(25.0)
    assert lb_report.time_to(c, 3.0) is None
    assert lb_report.loss_at(c, 25.0) == 5.0 and lb_report.loss_at(c, 5.0) is None


def test_ranking_by_time_to_sync_final_loss():
    s = load_scenario(EMULATED)
    cells = {"sync": [cell([10.0, 20.0], [5.0, 4.0], 20.0)],
             "fast": [cell([2.0, 4.0], [4.5, 3.9], 4.0)],
             "never": [cell([1.0, 2.0], [6.0, 5.5], 2.0)]}
    table = lb_report.summarize("emulated-default", s, cells)
    rows = [line for line in table if line.startswith("| ") and line[2].isdigit()]
    assert [r.split(" | ")[1] for r in rows] == ["fast", "sync", "never"]
    assert "not reached" in rows[2]


def test_a_seed_that_misses_the_target_counts_as_never_in_the_median():
    # 2 of 3 seeds reached: the median is the slower of the two, not their mean
    assert lb_report.median_of([63.0, 74.0, None]) == 74.0
    assert lb_report.median_of([1.0, 2.0, None, None]) is None and lb_report.median_of([1.0, None, None]) is None
    assert lb_report.median_of([3.0, 1.0, 2.0]) == 2.0 and lb_report.median_of([]) is None
    assert lb_report.time_spread([63.0, 74.0, None]) == "74 [63, not reached] (1 of 3 seeds not reached)"
    assert lb_report.time_spread([5.0, None, None]) == "not reached (1 of 3 seeds did: 5)"
    assert lb_report.time_spread([2.0, 1.0, 3.0]) == "2 [1, 3]" and lb_report.time_spread([4.0]) == "4"
    s = load_scenario(EMULATED)
    cells = {"sync": [cell([10.0, 20.0], [5.0, 4.0], 20.0)] * 3,
             "a": [cell([1.0], [3.9], 1.0), cell([3.5], [3.9], 3.5), cell([1.0], [4.5], 1.0)],
             "b": [cell([3.0], [3.9], 3.0)] * 3}
    assert [lb_report.time_to(c, 4.0) for c in cells["a"]] == [1.0, 3.5, None]
    rows = [line for line in lb_report.summarize("emulated-default", s, cells) if line.startswith("| ") and line[2].isdigit()]
    assert [r.split(" | ")[1] for r in rows] == ["b", "a", "sync"]  # a's median is 3.5 (not 2.25, the mean of two)


def test_a_reading_s_links_are_rebased_to_the_page_that_includes_it(tmp_path):
    reading = tmp_path / "docs" / "leaderboard" / "x.reading.md"
    reading.parent.mkdir(parents=True)
    reading.write_text("See [edit](../algorithms/edit.md#which-norms), [plot](x.png), [web](https://a.org/b.md) "
                       "and [here](#results).\n")
    assert lb_report.included(str(reading), str(tmp_path / "docs" / "leaderboard.md")) == (
        "See [edit](algorithms/edit.md#which-norms), [plot](leaderboard/x.png), [web](https://a.org/b.md) "
        "and [here](#results).")
    assert "[edit](../../docs/algorithms/edit.md#which-norms)" in lb_report.included(
        str(reading), str(tmp_path / "runs" / "leaderboard" / "leaderboard.md"))


def test_an_untrained_scenario_misses_every_cell_its_table_would_hold(tmp_path):
    # the board calls a scenario "not run" when every cell board_cells lists is missing:
    # variants and free-link ceilings included, or it would call it partly run
    args = argparse.Namespace(cache_dir=str(tmp_path), cached_only=True, steps=300, budget_cap=3, seeds=[1, 2, 3],
                              algorithms=",".join(recipes.ALGORITHMS))
    for name in lb.every_scenario():
        path = os.path.join(lb_setup.SCENARIO_DIR, f"{name}.toml")
        scenario = load_scenario(path)
        not_run = []
        runs = lb.scenario_rows(name, path, scenario, recipes.ALGORITHMS, str(tmp_path))
        assert lb.scenario_cells(name, path, scenario, runs, args, not_run) == {}
        assert sorted(not_run) == sorted(lb_setup.board_cells(name, args)), name


def test_a_edit_gets_a_sample_budget_and_lockstep_algorithms_iterations():
    assert "--train-samples" in lb_setup.cell_argv(EMULATED, "a-edit", 1, 100, 25, 2)
    argv = lb_setup.cell_argv(EMULATED, "diloco", 1, 100, 25, 2)
    assert argv[argv.index("--train-iters") + 1] == "100" and "--simulate-scenario" in argv


def test_every_variant_is_its_algorithm_with_its_flags_last_and_passes_the_argument_checks():
    from megatron_lsgd.training.arguments import build_config, parse_args

    varied = [name for name in lb.every_scenario() if recipes.board_variants(name)]
    assert varied  # the board has tuned rows (acco with fixed counts on the 4x straggler)
    for name in varied:
        path = os.path.join(lb_setup.SCENARIO_DIR, f"{name}.toml")
        sites = load_scenario(path).sites
        for label, algo, flags in recipes.board_variants(name):
            assert label.startswith(algo) and algo in recipes.ALGORITHMS
            argv = lb_setup.cell_argv(path, algo, 1, 100, 25, sites, extra=flags)
            assert argv[-len(flags) - 2:-2] == list(flags)  # after the recommended ones, before the length
            build_config(parse_args(argv), sites)


def test_the_free_link_ceiling_keeps_compute_and_settings(tmp_path):
    straggler = os.path.join(lb_setup.SCENARIO_DIR, "emulated-straggler2x.toml")
    free = load_scenario(lb_setup.free_link_copy(straggler, str(tmp_path)))
    s = load_scenario(straggler)
    assert lb_setup.has_slow_site(s) and not lb_setup.has_slow_site(load_scenario(EMULATED))
    assert free.rate_mbit == [0.0, 0.0] and free.latency_ms == [0.0, 0.0]
    assert (free.site_factors, free.microbatch_seconds, free.bytes_scale) == \
        (s.site_factors, s.microbatch_seconds, s.bytes_scale)
    # The ceiling runs a-edit with the interval recommended for the real link, not for a free one.
    argv = lb_setup.cell_argv(free.path, "a-edit", 1, 100, 25, 2, settings_from=straggler)
    real = lb_setup.cell_argv(straggler, "a-edit", 1, 100, 25, 2)
    assert [i for i, (a, b) in enumerate(zip(argv, real)) if a != b] == [argv.index(free.path)]
    interval = argv[argv.index("--lsgd-aedit-interval-seconds") + 1]
    assert float(interval) == pytest.approx(recipes.recommended_interval(s) * 0.058, rel=1e-3)


def test_open_targets_are_judged_from_the_cells():
    board = {
        "emulated-default": {
            "sync": [cell([10.0, 20.0], [5.0, 4.0], 20.0)],
            "cocodc": [dict(cell([1.0, 2.0], [4.5, 3.5], 2.0), valid_iterations=[5, 10])],  # 4.0 at step 7.5
            "streaming-diloco": [dict(cell([1.0, 2.0], [4.5, 4.0], 2.0), valid_iterations=[5, 10])],  # step 10
            "dreamddp": [cell([1.0, 2.0], [4.5, 4.1], 2.0)],  # never reaches 4.0
            "diloco": [cell([1.0, 2.0], [4.5, 4.0], 2.0)]},
        "emulated-1gbit-straggler4x": {
            "sync": [cell([10.0, 20.0], [5.0, 4.0], 20.0)],
            "acco": [cell([4.0, 8.0], [4.5, 4.0], 8.0)]},  # 8 / 20
    }
    rows = {r.split(" | ")[0][2:].split(",")[0]: r for r in lb_report.open_targets(board)[2:]}
    assert rows["acco"].endswith("| 0.4 (8 s vs 20 s; 1 seed) | yes |")
    assert rows["cocodc vs streaming-diloco: steps to sync's final loss"].endswith("| 0.75 (7.5 steps vs 10 steps; 1 seed) | yes |")
    assert rows["dreamddp vs diloco: time to sync's final loss"].endswith("| only diloco reaches it | **no** |")
    assert rows["a-edit"].endswith("| not run |  |")
    board["emulated-straggler2x"] = {"sync": [cell([10.0, 20.0], [5.0, 4.0], 20.0)],  # +2%: 4.08
                                     "a-edit": [cell([1.0, 2.0], [4.5, 4.08], 2.0)],
                                     "a-edit (free link)": [cell([1.0, 1.8], [4.5, 4.08], 1.8)]}
    assert dict((r.split(" | ")[0][2:].split(",")[0], r) for r in lb_report.open_targets(board)[2:])["a-edit"].endswith(
        "| 0.9 (2 s vs 1.8 s; 1 seed) | yes |")  # the ceiling's time over a-edit's: higher is better


def test_each_seed_is_judged_against_syncs_run_with_the_same_seed():
    def seeded(seed, *args):
        return dict(cell(*args), argv=["--seed", str(seed)])

    cells = {"sync": [seeded(1, [10.0, 20.0], [5.0, 4.0], 20.0), seeded(2, [10.0, 20.0], [5.0, 3.0], 20.0)],
             "algo": [seeded(1, [1.0, 2.0], [4.5, 4.0], 2.0), seeded(2, [1.0, 2.0], [4.5, 3.5], 2.0)]}
    targets = lb_report.Targets(cells)
    assert [targets.loss_for(c) for c in cells["algo"]] == [4.0, 3.0]  # not the median 3.5 for both
    assert lb_report.time_to(cells["algo"][0], targets.loss_for(cells["algo"][0])) == 2.0
    assert lb_report.time_to(cells["algo"][1], targets.loss_for(cells["algo"][1])) is None  # seed 2's sync got lower
    assert targets.loss_for(seeded(3, [1.0], [4.0], 1.0)) == 3.5  # a seed sync did not run: the median


def test_a_cell_is_found_from_any_checkout_and_cache_directory(tmp_path):
    straggler = os.path.join(lb_setup.SCENARIO_DIR, "emulated-straggler2x.toml")
    here, there = tmp_path / "a", tmp_path / "b"
    here.mkdir(), there.mkdir()
    copies = [lb_setup.free_link_copy(straggler, str(d)) for d in (here, there)]
    argvs = [lb_setup.cell_argv(c, "a-edit", 1, 100, 25, 2, settings_from=straggler) for c in copies]
    assert len({lb.cell_digest(argv, c) for argv, c in zip(argvs, copies)}) == 1
    assert lb.resolved_arguments(lb.cell_flags(argvs[0])) == lb.resolved_arguments(lb.cell_flags(argvs[1]))
    assert lb.cell_digest(lb_setup.cell_argv(EMULATED, "sync", 1, 100, 25, 2), EMULATED) != \
        lb.cell_digest(lb_setup.cell_argv(EMULATED, "sync", 2, 100, 25, 2), EMULATED)


def _counting_sync_cell(tmp_path, monkeypatch):
    """(calls, args, sync_cell): emulated-default's sync cell, seed 1, cached under tmp_path,
    trained by a fake run_cell whose loss counts the trainings (`calls` lists their argv)."""
    calls = []
    monkeypatch.setattr(lb, "run_cell", lambda argv, sites: calls.append(argv) or {"valid": [float(len(calls))]})
    args = argparse.Namespace(cache_dir=str(tmp_path), cached_only=False)

    def sync_cell():
        return lb.cached_cell("emulated-default", "sync", EMULATED, "sync", 1, 2, args, 100, 25)

    return calls, args, sync_cell


def test_a_cell_cached_under_other_defaults_is_trained_again(tmp_path, monkeypatch, capsys):
    """A cell is named by its flags; what they resolve to catches one that leaned on a default
    changed since, while a flag added since (not in the cell) does not throw it away. A
    trained cell says what it cost in real time (a long board's progress) and keeps it."""
    calls, args, sync_cell = _counting_sync_cell(tmp_path, monkeypatch)
    first = sync_cell()
    resolved = lb.resolved_arguments(lb.cell_flags(first["argv"]))
    assert first["resolved"] == resolved and resolved["lr"] == 2e-3
    assert first["real_seconds"] >= 0
    assert first["platform"] == run_cache.platform_signature()  # whose last bits these are
    assert "> emulated-default / sync / seed 1: trained in 0 s of real time" in capsys.readouterr().out
    assert sync_cell() == first and len(calls) == 1
    monkeypatch.setattr(lb, "resolved_arguments", lambda flags: {**resolved, "a_flag_added_since": 3})
    assert sync_cell() == first and len(calls) == 1
    # another algorithm's own default moved (edit's clip did, 2026-11-28): nothing sync reads
    monkeypatch.setattr(lb, "resolved_arguments", lambda flags: {**resolved, "lsgd_edit_clip": 99.0})
    assert sync_cell() == first and len(calls) == 1
    monkeypatch.setattr(lb, "resolved_arguments", lambda flags: {**resolved, "lr": 1e-3})
    again = sync_cell()
    assert len(calls) == 2 and again["valid"] == [2.0] and again["resolved"]["lr"] == 1e-3
    assert "made under other defaults (lr resolve differently now)" in capsys.readouterr().out
    args.cached_only = True
    assert sync_cell() == again


def test_a_cell_of_an_older_clock_model_is_trained_again_or_marked(tmp_path, monkeypatch, capsys):
    """A trained cell records the clock model; one of another model (or none: model 1, cells
    made before it was recorded) is trained again, and --cached-only keeps it while its table
    says the cells were made under the older model."""
    import json

    from megatron_lsgd.core.simulation import CLOCK_MODEL

    calls, args, sync_cell = _counting_sync_cell(tmp_path, monkeypatch)
    first = sync_cell()
    assert first["clock_model"] == CLOCK_MODEL and sync_cell() == first and len(calls) == 1
    (path,) = tmp_path.glob("*.json")
    old = {k: v for k, v in first.items() if k != "clock_model"}  # as every cell made before 2026-11-29
    path.write_text(json.dumps(old))
    args.cached_only = True
    assert sync_cell() == old and len(calls) == 1  # kept as it is ...
    s = load_scenario(EMULATED)
    marked = [dict(cell([10.0, 20.0], [5.0, 4.0], 20.0)), dict(cell([10.0, 20.0], [5.0, 4.0], 20.0),
                                                                clock_model=CLOCK_MODEL)]
    table = lb_report.summarize("emulated-default", s, {"sync": marked})
    assert any(f"1 of these 2 cells were trained under clock model 1, not the current {CLOCK_MODEL}" in line
               for line in table)  # ... and its table says so
    assert not any("older simulated clock" in line for line in
                   lb_report.summarize("emulated-default", s, {"sync": marked[1:]}))
    args.cached_only = False
    again = sync_cell()
    assert len(calls) == 2 and again["clock_model"] == CLOCK_MODEL
    assert f"was made under clock model 1, not {CLOCK_MODEL}: trained again" in capsys.readouterr().out


def test_budget_steps_fit_syncs_time_at_the_pilots_pace():
    assert lb.budget_steps(300, budget=150.0, pilot_seconds=75.0, cap=3) == 600  # twice sync's pace
    assert lb.budget_steps(300, budget=150.0, pilot_seconds=10.0, cap=3) == 900  # 4500 fit: capped
    assert lb.budget_steps(300, budget=150.0, pilot_seconds=200.0, cap=3) == 300  # slower than sync: sync's steps
    assert lb.budget_steps(300, budget=150.0, pilot_seconds=0.0, cap=2) == 600


def test_a_scenario_runs_pilots_then_budget_sized_cells(monkeypatch, tmp_path):
    """sync sets the budget; each other algorithm gets a pilot (seed 1, no evaluation) and then
    the steps that fit; the free-link ceiling trains the steps of the algorithm it bounds; a
    tuned variant gets a pilot of its own."""
    calls = []
    pace = {"sync": 2.0, "diloco": 0.25, "a-edit": 0.5, "slow diloco": 1.0}  # simulated seconds per step

    announced = []

    def fake(name, label, path, algo, seed, sites, args, steps, eval_interval, extra=(), progress=""):
        calls.append((label, seed, steps, eval_interval))
        announced.append(progress)
        return dict(cell([1.0], [4.0], steps * pace["slow diloco" if extra else algo]), steps=steps, seed=seed)

    monkeypatch.setattr(lb, "cached_cell", fake)
    straggler = os.path.join(lb_setup.SCENARIO_DIR, "emulated-straggler2x.toml")
    s = load_scenario(straggler)
    free = lb_setup.free_link_copy(straggler, str(tmp_path))
    runs = [lb_setup.Run("a-edit (free link)", "a-edit", free), lb_setup.Run("sync", "sync", straggler),
            lb_setup.Run("diloco", "diloco", straggler), lb_setup.Run("a-edit", "a-edit", straggler),
            lb_setup.Run("diloco (H 7)", "diloco", straggler, ("--lsgd-interval", "7"))]

    class Args:
        steps, seeds, budget_cap = 100, [1, 2], 3

    not_run, spent = [], []
    cells = lb.scenario_cells("emulated-straggler2x", straggler, s, runs, Args, not_run, spent)
    assert not not_run
    assert len(spent) == 2 + 3 + 4 * 2  # sync's seeds once, three pilots, four rows of two seeds
    assert announced == [f"cell {i} of 13 in this scenario, cached ones included" for i in range(1, 14)]
    assert ("diloco pilot", 1, 100, 0) in calls and ("a-edit pilot", 1, 100, 0) in calls
    assert not any(label == "sync pilot" or label.startswith("a-edit (free link) pilot") for label, *_ in calls)
    assert [c["steps"] for c in cells["sync"]] == [100, 100]
    assert [c["steps"] for c in cells["diloco"]] == [300, 300]  # 800 fit in sync's 200 s: capped at 3x
    assert [c["steps"] for c in cells["a-edit"]] == [300, 300] and \
        [c["steps"] for c in cells["a-edit (free link)"]] == [300, 300]  # 400 fit: capped
    assert ("diloco", 2, 300, lb.eval_interval_for(300)) in calls
    assert ("diloco (H 7) pilot", 1, 100, 0) in calls  # its own pace: 200 steps fit in sync's 200 s
    assert [c["steps"] for c in cells["diloco (H 7)"]] == [200, 200]

    calls.clear()  # seeds 2-3 only (--seeds 2-3): each pairs with sync's cell of its own seed
    Args.seeds = [2, 3]
    cells = lb.scenario_cells("emulated-straggler2x", straggler, s, runs, Args, not_run)
    assert [c["seed"] for c in cells["sync"]] == [2, 3] and [c["seed"] for c in cells["diloco"]] == [2, 3]
    assert {seed for label, seed, *_ in calls if label == "diloco"} == {2, 3}
    assert not not_run


def test_seeds_are_a_count_a_range_or_a_list():
    from tools.benchmarks.run_cache import seed_list
    assert seed_list("3") == [1, 2, 3] and seed_list("1") == [1]
    assert seed_list("2-3") == [2, 3] and seed_list("2-2") == [2]
    assert seed_list("1,3") == [1, 3]
    for bad in ("0", "x", "3-2", "1,1", "0,2", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            seed_list(bad)


def test_the_board_lists_only_scenarios_with_cells_not_run(tmp_path):
    import argparse
    args = argparse.Namespace(out=str(tmp_path / "leaderboard.md"), steps=300, budget_cap=3, seeds=[1, 2, 3],
                              algorithms="sync,diloco")
    text = lb_report.document(["emulated-default", "emulated-straggler2x"], [], args,
                       {"emulated-default": [], "emulated-straggler2x": ["diloco seed 2"]})
    assert "Cells not run in emulated-straggler2x: diloco seed 2." in text
    assert "Cells not run in emulated-default" not in text


def test_a_seed_with_no_cell_is_named_once(tmp_path):
    import argparse
    args = argparse.Namespace(out=str(tmp_path / "leaderboard.md"), steps=300, budget_cap=3, seeds=[1, 2, 3],
                              algorithms="sync,diloco")
    missing = ["diloco seed 1", "sync seed 2", "diloco seed 2", "sync seed 3", "diloco seed 3"]
    text = lb_report.document(["emulated-default"], [], args, {"emulated-default": missing})
    assert "Cells not run in emulated-default: seed 2 (every cell), seed 3 (every cell), diloco seed 1." in text


def test_cached_only_without_cells_leaves_the_board_alone(tmp_path, monkeypatch, capsys):
    """A checkout without the cells must not replace a board's tables with an empty one; the
    default cache is the committed one under results/."""
    out = tmp_path / "leaderboard.md"
    out.write_text("the tables\n")
    monkeypatch.setattr("sys.argv", ["leaderboard.py", "--cached-only", "--scenarios", "emulated-default",
                                     "--cache-dir", str(tmp_path / "cells"), "--out", str(out),
                                     "--plots-dir", str(tmp_path / "plots")])
    with pytest.raises(SystemExit) as exit_:
        lb.main()
    assert exit_.value.code == 2 and out.read_text() == "the tables\n"
    assert "error: --cached-only: no finished cell under" in capsys.readouterr().err
    assert lb.CELLS_DIR == os.path.join(lb.ROOT, "results", "leaderboard", "cells")


def test_the_board_says_what_its_cells_cost_to_train():
    spent = {"emulated-default": [60.0, 120.0, None], "2x8gpu-1gbit-1b": [1620.0], "8site-internet-150m": []}
    assert lb_report.cost_line(spent) == [
        "Cost: training these 4 cells (pilots included) took 0.5 h of this machine's real time "
        "(emulated-default 3 min, 2x8gpu-1gbit-1b 27 min); 1 cell(s) did not keep theirs.", ""]
    assert lb_report.cost_line({"emulated-default": [None]}) == [] and lb_report.cost_line({}) == []


def test_a_part_of_the_board_does_not_replace_the_published_one(tmp_path, monkeypatch, capsys):
    every, algorithms = lb.every_scenario(), list(recipes.ALGORITHMS)
    assert lb.default_board(every, algorithms, [1, 2, 3]) == lb.BOARD == os.path.join(lb.ROOT, "docs", "leaderboard.md")
    assert lb.default_board(every, algorithms, [1, 2, 3, 4]) == lb.BOARD
    for names, algos, seeds in ((every[:1], algorithms, [1, 2, 3]), (every, algorithms[:2], [1, 2, 3]),
                                (every, algorithms, [1]), (every, algorithms, [2, 3])):
        assert lb.default_board(names, algos, seeds) == lb.PARTIAL_BOARD
    # the documented example trains a few cells: its board and plots go under runs/, not docs/
    monkeypatch.setattr(lb, "PARTIAL_BOARD", str(tmp_path / "partial" / "leaderboard.md"))
    monkeypatch.setattr("sys.argv", ["leaderboard.py", "--cached-only", "--scenarios", "emulated-default",
                                     "--seeds", "1", "--cache-dir", str(tmp_path / "cells")])
    with pytest.raises(SystemExit):
        lb.main()
    out, err = capsys.readouterr()
    assert "a part of the board (--scenarios, --algorithms or --seeds): written to" in out
    assert f"{tmp_path / 'partial' / 'leaderboard.md'} is left as it is" in err
    assert (tmp_path / "partial" / "leaderboard").is_dir()  # its plots beside it


@pytest.mark.parametrize("flag", ["--steps", "--budget-cap"])
def test_a_count_that_is_not_positive_is_refused(flag, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["leaderboard.py", "--cached-only", "--cache-dir", str(tmp_path), "--out",
                                     str(tmp_path / "board.md"), flag, "0"])  # (trains nothing if the check is gone)
    with pytest.raises(SystemExit) as exit_:
        lb.main()
    assert exit_.value.code == 2 and f"error: argument {flag}: '0' is not a positive whole number" in \
        capsys.readouterr().err


def test_costs_are_the_wall_clock_step_of_sites_training_at_once(monkeypatch):
    """--measure-costs: each site's extra steps of its long run over its short one, in wall-clock
    seconds (and CPU beside), the median over the sites; every site gets its own world."""
    import json

    seen = {}

    def fake_ranks(worker, args, world):
        ports, short, long, out_dir = args
        seen.update(world=world, ports=ports, short=short, long=long)
        walls = [(2.0, 6.0), (2.5, 7.3), (2.2, 6.6)]  # wall seconds of the short and long run per site
        for rank in range(world):
            spent = {str(short): [walls[rank][0], 1.0], str(long): [walls[rank][1], 1.0 + 0.025 * (long - short)]}
            with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
                json.dump(spent, f)

    monkeypatch.setattr(lb, "run_ranks", fake_ranks)
    wall, cpu = lb.measure_costs(3, short=10, long=50)
    assert seen["world"] == 3 and len(set(seen["ports"])) == 3
    assert wall == pytest.approx(4.4 / 40)  # the median of 4.0, 4.8 and 4.4 s over 40 steps
    assert cpu == pytest.approx(0.025)


def test_a_damaged_cell_is_one_error_naming_it_before_its_clock_model_is_read(tmp_path):
    cell = tmp_path / "cell.json"
    cell.write_text('{"valid": [1.0')
    with pytest.raises(ValueError, match=r"cached result .*cell.json is damaged"):
        lb.older_clock_model(str(cell))


def test_a_scenario_of_unequal_sites_trains_one_rank_per_replica_and_leaves_out_what_refuses_it(tmp_path):
    from megatron_lsgd.training.arguments import build_config, parse_args

    path = os.path.join(lb_setup.SCENARIO_DIR, "2site-16-8gpu-1gbit-1b.toml")
    s = load_scenario(path)
    assert s.replicas_per_site == [2, 1] and lb_setup.cell_ranks(s) == 3
    argv = lb_setup.cell_argv(path, "diloco", 1, 100, 25, s.sites)
    assert argv[argv.index("--site-data-parallel-sizes") + 1] == "2,1"
    assert argv[argv.index("--global-batch-size") + 1] == str(3 * lb_setup.MICRO_BATCH)  # one micro-batch a replica
    assert build_config(parse_args(argv), 3).dims.site_dp == (2, 1)
    rows = [run.label for run in lb_setup.scenario_runs("2site-16-8gpu-1gbit-1b", path, s, recipes.ALGORITHMS, "")]
    assert rows == ["sync", "diloco", "dilocox", "streaming-diloco", "cocodc"]  # the others refuse such sites
    for algorithm in rows:  # each row's cell starts: its recommended flags (dilocox's int4) take such sites too
        build_config(parse_args(lb_setup.cell_argv(path, algorithm, 1, 100, 25, s.sites)), 3)
    note = " ".join(lb_report.unequal_note(s))
    assert "--site-data-parallel-sizes 2,1" in note and "edit (" in note and "sync (" not in note
    assert "dilocox (" not in note and "streaming-diloco (" not in note and "cocodc (" not in note
    assert lb_report.unequal_note(load_scenario(EMULATED)) == []
    # the run's sites must be the scenario's: one line naming the flag
    with pytest.raises(ValueError, match=r"its sites have 2,1 data-parallel replicas \(replicas_per_site\), this run "
                                         r"1,1: give --site-data-parallel-sizes 2,1"):
        build_config(parse_args([a for a in argv if a not in ("--site-data-parallel-sizes", "2,1")]
                                + ["--global-batch-size", "8"]), 2)
    bad = tmp_path / "bad.toml"
    for value in ("[2]", "[2, 0]", "[2, 1.5]", "3"):
        bad.write_text(f"sites = 2\nreplicas_per_site = {value}\n")
        with pytest.raises(ValueError, match="replicas_per_site = .* must list one whole number >= 1 per site"):
            load_scenario(str(bad))
    free = load_scenario(lb_setup.free_link_copy(path, str(tmp_path)))  # a ceiling keeps the sites' sizes
    assert free.replicas_per_site == [2, 1] and free.rate_mbit == [0.0, 0.0]


def test_the_re_based_board_trains_the_ladders_rung_s_on_docs_corpus(tmp_path, monkeypatch, capsys):
    """--stand-in docs-corpus (issue 45 item 7): every cell trains the quality ladder's rung S
    (2 x 48, sequence 256, lr 3e-3 to 3e-4, docs-corpus's train and held-out documents, 40
    evaluation batches), 16 sequences a step at 2 sites as the ladder, sync 1,262 steps (20
    tokens per parameter) by default; the flags pass the argument checks; its page and plots
    are its own (docs/leaderboard-docs-corpus.md), published from every algorithm at 3 seeds on
    any scenarios; without the prepared corpus it stops at once naming the flag and the command
    that prepares it. The toy's cells are found as before (the flags frozen by test_recipes)."""
    from megatron_lsgd.training.arguments import build_config, parse_args

    docs = lb_setup.STAND_INS["docs-corpus"]
    argv = lb_setup.cell_argv(EMULATED, "diloco", 1, docs.steps, 105, 2, stand_in=docs)
    flag = lambda name: argv[argv.index(name) + 1]  # noqa: E731
    assert (flag("--num-layers"), flag("--hidden-size"), flag("--seq-length")) == ("2", "48", "256")
    assert (flag("--micro-batch-size"), flag("--global-batch-size"), flag("--train-iters")) == ("8", "16", "1262")
    assert (flag("--lr"), flag("--min-lr"), flag("--lr-warmup-iters"), flag("--eval-iters")) == ("3e-3", "3e-4", "63", "40")
    assert flag("--train-data-path").endswith("docs_corpus_train_text_document") and "--data-path" not in argv
    assert flag("--valid-data-path").endswith("docs_corpus_valid_text_document")
    assert "--full-validation" not in argv
    build_config(parse_args(argv), 2)
    pilot = lb_setup.cell_argv(EMULATED, "diloco", 1, docs.steps, 0, 2, stand_in=docs)
    assert pilot[pilot.index("--eval-iters") + 1] == "0"
    assert lb_setup.cell_argv(EMULATED, "diloco", 1, 300, 25, 2) == \
        lb_setup.cell_argv(EMULATED, "diloco", 1, 300, 25, 2, stand_in=lb_setup.TOY)
    published, partial = lb.board_pages("docs-corpus")
    assert published == os.path.join(lb.ROOT, "docs", "leaderboard-docs-corpus.md") and partial.startswith(
        os.path.join(lb.ROOT, "runs"))
    every = list(recipes.ALGORITHMS)
    two = ["emulated-default", "2x8gpu-1gbit-1b"]
    assert lb.default_board(two, every, [1, 2, 3], "docs-corpus") == published
    assert lb.default_board(two, every, [1], "docs-corpus") == partial
    assert lb.default_board(two, every, [1, 2, 3]) == lb.PARTIAL_BOARD  # the toy's needs every scenario
    missing = lb_setup.StandIn(**{**docs.__dict__, "files": (str(tmp_path / "nowhere.bin"),)})
    monkeypatch.setitem(lb.STAND_INS, "docs-corpus", missing)
    monkeypatch.setattr("sys.argv", ["leaderboard.py", "--stand-in", "docs-corpus", "--scenarios", "emulated-default",
                                     "--cache-dir", str(tmp_path / "cells")])
    with pytest.raises(SystemExit) as exit_:
        lb.main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "error: --stand-in docs-corpus:" in err and "nowhere.bin is missing" in err
    assert "tools/prepare_corpus.py" in err and not (tmp_path / "cells").exists()
