"""DreamDDP's scheduler, profile and plan without processes: the time model by hand, the
DFS against brute force on random profiles (L <= 12 units, H <= 5), each pruning rule
exercised, bubble filling, the equal-number baseline, the tied-embedding rule, the link
fit, drift detection and the profile file's errors."""

from __future__ import annotations

import json
import math
import random

import pytest

from megatron_lsgd.core.lsgd.algorithms.dreamddp.plan import build_plan, contiguous_count, format_plan
from megatron_lsgd.core.lsgd.algorithms.dreamddp.profile import (Profile, UnitProfile, fit_link, global_index, global_name,
                                                      fastest_sample, probe_sizes, read_profile_file, stage_of)
from megatron_lsgd.core.lsgd.algorithms.dreamddp.scheduler import (Problem, brute_force_schedule, dfs_schedule,
                                                        equal_number_schedule, fill_bubbles, schedule, slot_end,
                                                        slot_exposed, total_exposed)
from megatron_lsgd.core.lsgd.algorithms.dreamddp.synchronizer import drifted
from tools.benchmarks.parts.dreamddp_scheduler_bench import random_problem


def test_time_model_by_hand():
    # backward completes at 1, 3, 4; deadline 4 + tail 1 = 5
    p = Problem((1.0, 2.0, 1.0), (3.0, 1.0, 2.0), tail=1.0)
    assert p.completions == [1.0, 3.0, 4.0] and p.deadline == 5.0
    assert slot_end(p, [0]) == 4.0 and slot_exposed(p, [0]) == 0.0
    assert slot_end(p, [0, 1]) == 5.0 and slot_exposed(p, [0, 1]) == 0.0  # unit 1 queues behind unit 0
    assert slot_end(p, [0, 1, 2]) == 7.0 and slot_exposed(p, [0, 1, 2]) == 2.0  # FIFO: 2 starts at 5
    assert slot_end(p, [1, 2]) == 6.0  # 1: 3 -> 4, 2: starts at its backward end 4 -> 6
    assert slot_exposed(p, []) == 0.0
    assert total_exposed(p, [[0, 1], [2]]) == 1.0  # 2 alone: 4 -> 6, deadline 5
    # H = 1: one slot holds everything; H = 3: one unit per slot
    assert dfs_schedule(p, 1).slots == [[0, 1, 2]] and dfs_schedule(p, 1).exposed == 2.0
    assert dfs_schedule(p, 3).slots == [[0], [1], [2]] and dfs_schedule(p, 3).exposed == 1.0
    # more slots than units: the extra slots stay empty
    five = dfs_schedule(p, 5)
    assert five.slots == [[0], [1], [2], [], []] and five.exposed == 1.0


def test_dfs_equals_brute_force_on_random_profiles():
    rng = random.Random(20261123)
    ratios, dfs_nodes, brute_nodes, equal = [], 0, 0, 0
    rules = {"optimal_hiding": 0, "delayed_overflow": 0, "at_least_one": 0, "branch": 0}
    for _ in range(400):
        L, H = rng.randint(1, 12), rng.randint(1, 5)
        p = random_problem(rng, L)
        dfs, brute = dfs_schedule(p, H), brute_force_schedule(p, H)
        # a valid contiguous assignment: every unit exactly once, blocks in backward order
        assert len(dfs.slots) == H and [u for s in dfs.slots for u in s] == list(range(L))
        assert math.isclose(dfs.exposed, total_exposed(p, dfs.slots), abs_tol=1e-12)
        assert dfs.exposed >= brute.exposed - 1e-12, "brute force is the minimum"
        equal += dfs.exposed <= brute.exposed + 1e-12
        ratios.append((dfs.exposed + 1e-9) / (brute.exposed + 1e-9))
        dfs_nodes += dfs.nodes
        brute_nodes += brute.nodes
        for k in rules:
            rules[k] += dfs.stats[k]
    # The issue asks for "equal in the large majority, never worse than 1.05x on average";
    # the three rules only discard dominated branches, so the DFS is exact here.
    assert equal == 400 and max(ratios) <= 1 + 1e-9
    assert dfs_nodes < 0.1 * brute_nodes, (dfs_nodes, brute_nodes)
    assert all(v > 0 for v in rules.values()), rules  # every rule was exercised


def test_brute_force_counts_every_contiguous_assignment():
    p = Problem((1.0,) * 6, (0.5,) * 6)
    leaves = []
    for H in (1, 2, 4):
        # nodes of the unpruned tree = sum over prefixes of the ways to place them
        nodes = brute_force_schedule(p, H).nodes
        leaves.append(contiguous_count(6, H))
        assert nodes > contiguous_count(6, H)
    assert leaves == [1, 7, 84]


def test_bubble_filling_adds_only_free_averages():
    rng = random.Random(7)
    for _ in range(200):
        L, H = rng.randint(1, 10), rng.randint(1, 5)
        p = random_problem(rng, L)
        base = dfs_schedule(p, H).slots
        filled = fill_bubbles(p, base)
        for b, f in zip(base, filled):
            assert set(b) <= set(f) and f == sorted(f)
            assert slot_exposed(p, f) <= slot_exposed(p, b)
        assert sorted({u for s in filled for u in s}) == list(range(L))
    # A fast link: everything hides, so bubble filling averages every unit every iteration.
    fast = Problem((1.0,) * 4, (0.1,) * 4, tail=0.5)
    assert schedule(fast, 3)[0] == [[0, 1, 2, 3]] * 3
    # The output side finishes backward early: with room left, slot 2 (units 2, 3) also takes
    # unit 0, whose average fits before unit 2's backward ends.
    p = Problem((1.0, 1.0, 1.0, 1.0), (1.0, 3.0, 1.0, 0.5))
    assert dfs_schedule(p, 2).slots == [[0, 1], [2, 3]]
    assert fill_bubbles(p, [[0, 1], [2, 3]]) == [[0, 1], [0, 2, 3]]
    assert schedule(p, 2, bubble_fill=False)[0] == [[0, 1], [2, 3]]


def test_equal_number_partition():
    p = Problem((1.0,) * 7, (1.0,) * 7)
    assert equal_number_schedule(p, 3).slots == [[0, 1, 2], [3, 4], [5, 6]]
    assert equal_number_schedule(p, 9).slots[7:] == [[], []]
    with pytest.raises(ValueError, match="scheduler 'x'"):
        schedule(p, 2, "x")
    with pytest.raises(ValueError):
        Problem((1.0,), (-1.0,))


def _profile(tied: bool) -> Profile:
    # 4 layers on 2 stages: stage 0 = embedding, layers.0-1; stage 1 = layers.2-3, output
    names = ["embedding", "layers.0", "layers.1", "layers.2", "layers.3", "output"]
    units = [UnitProfile(n, stage_of(global_index(n, 4), 4, 2), 1e-3, 2**20 * (3 if n in ("embedding", "output")
                                                                              else 1), 1) for n in names]
    return Profile(units, [1e-4, 2e-4], latency_s=1e-4, seconds_per_byte=1e-3 / 2**20, tied_embeddings=tied)


def test_unit_positions():
    assert [global_name(i, 4) for i in range(6)] == ["embedding", "layers.0", "layers.1", "layers.2", "layers.3",
                                                     "output"]
    assert [stage_of(i, 4, 2) for i in range(6)] == [0, 0, 0, 1, 1, 1]
    assert all(global_index(global_name(i, 4), 4) == i for i in range(6))


def test_plan_stages_and_tied_embeddings_share_slots():
    untied = build_plan(_profile(False), 3, "dfs", False)
    assert [st.names for st in untied.stages] == [["layers.1", "layers.0", "embedding"],
                                                   ["output", "layers.3", "layers.2"]]
    emb = {h for h, s in enumerate(untied.stages[0].slots) if "embedding" in s}
    out = {h for h, s in enumerate(untied.stages[1].slots) if "output" in s}
    assert emb != out  # the embedding is last in backward on stage 0, the head first on stage 1
    tied = build_plan(_profile(True), 3, "dfs", False)
    emb = {h for h, s in enumerate(tied.stages[0].slots) if "embedding" in s}
    out = {h for h, s in enumerate(tied.stages[1].slots) if "output" in s}
    assert emb == out and len(emb) == 2
    for st in tied.stages:  # slots stay in backward order; every unit at least once
        assert all(s == [n for n in st.names if n in s] for s in st.slots)
        assert {n for s in st.slots for n in s} == set(st.names)
    text = format_plan(tied, _profile(True), "test")
    assert "stage 1:" in text and "slot 1:" in text and "per period" in text


def test_link_fit_and_probe_sizes():
    samples = [(n, 0.02 + n * 1e-8) for n in (4096, 65536, 2**22)]
    latency, slope = fit_link(samples)
    assert math.isclose(latency, 0.02, rel_tol=1e-9) and math.isclose(slope, 1e-8, rel_tol=1e-9)
    assert fit_link([(4096, 0.5), (8192, 0.4)]) == (0.45, 0.0)  # never a negative slope
    assert fit_link([(4096, 0.0), (8192, 0.02)])[0] == 0.0  # nor a negative latency
    sizes = probe_sizes(3 * 2**20)
    assert sizes[0] == 4096 and sizes[-1] == 3 * 2**20 and len(sizes) == 3
    assert probe_sizes(10**12)[-1] == 4 * 2**20 and all(s % 4 == 0 for s in probe_sizes(12345))


def test_fastest_sample_skips_unseen_start():
    samples = [{"backward": {"a": float("nan"), "b": 2.0}, "tail": 1.0},
               {"backward": {"a": 3.0, "b": 4.0}, "tail": 3.0},
               {"backward": {"a": 5.0, "b": 6.0}, "tail": 2.0}]
    assert fastest_sample(samples, ["a", "b"]) == ({"a": 3.0, "b": 2.0}, 1.0)
    assert fastest_sample([{"backward": {"a": float("nan")}, "tail": 0.5}], ["a"]) == ({"a": 0.0}, 0.5)


def test_drift_detection():
    profile = _profile(False)
    plan = build_plan(profile, 3, "dfs", True)
    predicted = max(sum(st.exposed_s) / 3 for st in plan.stages)
    phase = max(profile.problem(s).deadline for s in (0, 1)) + predicted
    assert not drifted(profile, plan, profile, predicted, 0.25)
    slower = _profile(False)
    for u in slower.units:
        u.backward_s *= 1.5
    assert drifted(profile, plan, slower, predicted, 0.25)
    assert drifted(profile, plan, profile, predicted + 0.3 * phase, 0.25)  # the link got slower
    assert not drifted(profile, plan, profile, predicted + 0.2 * phase, 0.25)
    assert drifted(profile, plan, profile, max(0.0, predicted - 0.3 * phase), 0.25) == (predicted > 0.25 * phase)


def test_profile_file_round_trip_and_errors(tmp_path):
    profile = _profile(True)
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"profile": profile.to_dict()}))
    parsed = read_profile_file(str(path))
    assert parsed["backward_ms"]["layers.2"] == pytest.approx(1.0) and parsed["tails_ms"] == pytest.approx([0.1, 0.2])
    assert set(parsed["backward_ms"]) == {u.name for u in profile.units}
    with pytest.raises(ValueError, match="--lsgd-dreamddp-profile .*cannot read"):
        read_profile_file(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="--lsgd-dreamddp-profile .*not JSON"):
        read_profile_file(str(tmp_path / "bad.json"))
    (tmp_path / "other.json").write_text(json.dumps({"units": []}))
    with pytest.raises(ValueError, match="not a dreamddp profile"):
        read_profile_file(str(tmp_path / "other.json"))


def test_the_bench_writes_its_table_into_docs_and_its_json_under_results(tmp_path, monkeypatch):
    import os

    from tools.benchmarks.parts import dreamddp_scheduler_bench
    from tools.benchmarks import run_cache

    monkeypatch.setattr(run_cache, "DOCS", str(tmp_path / "docs"))
    monkeypatch.setattr(run_cache, "RESULTS", str(tmp_path / "results"))
    pages = tmp_path / "docs" / "algorithms" / "results" / "dreamddp"
    assert dreamddp_scheduler_bench.main(["--cases", "20", "--max-units", "4", "--max-slots", "3",
                                          "--unrestricted-max-units", "3", "--out-dir", str(pages)]) == 0
    raw = tmp_path / "results" / "algorithms" / "results" / "dreamddp" / "scheduler.json"
    assert json.load(open(raw))["summary"]
    assert "scheduler.md" in os.listdir(pages) and "scheduler.json" not in os.listdir(pages)
