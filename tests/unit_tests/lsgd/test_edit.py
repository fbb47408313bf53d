"""End-to-end properties of edit on spawned CPU/gloo ranks (tiny models).

- penalty off, H=1, outer lr 1, momentum 0: edit is per-step parameter averaging, bit for bit
  the same run as diloco with those settings (TP2 x PP2 x 2 sites with prefetch, ZeRO-1 with
  DP_intra 2 without);
- with the penalty, TP2 x PP2 with tied embeddings takes the same decisions (norms over whole
  units) as one rank per site; sites end with identical models and anchors, the last
  stage's copy of the word embedding stays identical to the first stage's, and a sync where
  every site blows up rolls back;
- a site whose pseudo-gradient is blown up is flagged and excluded: the loss stays within 1%
  of the clean run, where plain averaging degrades it many times over; prefetch on and off
  give identical numbers;
- evaluated at a sync boundary, edit and a-edit see the synced model: with plain averaging
  (penalty off, outer lr 1, momentum 0) and H = 2 they report bit for bit diloco's
  validation losses, where each site's local model would give others.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit_tests.harness import (assert_replicas_identical, logged_losses, merge_full_params, run_distributed,
                                      run_distributed_many)
from tests.unit_tests.lsgd.test_algorithms import COMMON, LAYOUTS, SGD, assert_anchors_identical, assert_close_runs

AVERAGING = ["--lsgd-interval", "1", "--lsgd-outer-lr", "1", "--lsgd-outer-momentum", "0"]
# DP_intra 2 without ZeRO-1: each rank of a site exchanges half of every unit, the site gathers
DP2 = (4, ["--num-sites", "2", "--ddp-bucket-size", "5000"])


def assert_same_run(a, b):
    assert logged_losses(a) == logged_losses(b)
    for ra, rb in zip(a, b):
        for name in ra["params"]:
            assert torch.equal(ra["params"][name]["value"], rb["params"][name]["value"]), name


def assert_tied_copies_identical(records):
    name = "embedding.word_embeddings.weight"  # the last stage's output weight has the same global name
    copies = {}
    for r in records:
        c = r["coords"]
        copies.setdefault((c.site, c.dp_intra, c.tp), []).append(r["params"][name]["value"])
    assert all(len(v) == 2 for v in copies.values())
    for key, (first, last) in copies.items():
        assert torch.equal(first, last), f"tied word embedding copies differ at (site, dp, tp) = {key}"


@pytest.mark.slow
@pytest.mark.parametrize("layout,prefetch", [("tp2-pp2-sites2", "2"), ("zero1-sites2", "0")])
def test_edit_without_penalty_at_h1_is_per_step_parameter_averaging(layout, prefetch):
    world, args = LAYOUTS[layout]
    diloco = run_distributed(COMMON + args + ["--lsgd-algorithm", "diloco"] + AVERAGING, world)
    edit = run_distributed(COMMON + args + ["--lsgd-algorithm", "edit", "--lsgd-edit-penalty", "none",
                                            "--lsgd-edit-prefetch", prefetch] + AVERAGING, world)
    assert_same_run(edit, diloco)
    assert_replicas_identical(edit)
    assert edit[-1]["sync_stats"]["syncs"] == 6 and edit[-1]["comm"]["bytes_sent"] > 0


@pytest.mark.slow
def test_penalty_norms_span_tp_pp_and_the_tied_copy_and_all_flagged_rolls_back():
    """The penalty's norms are over each unit's whole parameters, so TP2 x PP2 and DP_intra 2
    take the same decisions as one rank per site (to float rounding): replicated parameters
    count once and the last stage's tied copy follows the first stage's embedding."""
    # 1 warm-up step, then syncs after local steps 2, 4, 6 and a partial last round; at sync 3
    # every site's pseudo-gradient is 1e4 times too large: all flagged, every unit rolls back.
    args = COMMON + SGD + ["--train-iters", "8", "--lsgd-algorithm", "edit", "--lsgd-interval", "2",
                           "--lsgd-warmup-iters", "1", "--lsgd-edit-ema-warmup", "2", "--lsgd-edit-prefetch", "0",
                           "--lsgd-edit-inject-fault", "all:3:1e4"]
    ref = run_distributed(args + LAYOUTS["sites2"][1], 2)
    world, layout = LAYOUTS["tp2-pp2-sites2"]
    records = run_distributed(args + layout, world)
    assert_close_runs(records, ref)
    assert_replicas_identical(records)
    assert_anchors_identical(records)
    assert_tied_copies_identical(records)
    # DP_intra 2 (a site's samples are split differently from one rank per site, so local
    # steps differ): each rank's ZeRO-1 slices vs, without ZeRO-1, its half of every unit
    world, layout = LAYOUTS["zero1-sites2"]
    zero1 = run_distributed(args + layout, world)
    split = run_distributed(args + DP2[1] + ["--lsgd-outer-offload"], DP2[0])  # host-side outer state too
    assert_close_runs(split, zero1)
    assert_replicas_identical(split)
    # both split a site's traffic over its two ranks (each sends about half of every unit)
    site0 = [r["comm"]["bytes_sent"] for r in split if r["coords"].site == 0]
    assert abs(sum(site0) / sum(r["comm"]["bytes_sent"] for r in zero1 if r["coords"].site == 0) - 1) < 0.01
    assert max(site0) < 0.51 * sum(site0)
    assert_replicas_identical(zero1)
    assert zero1[-1]["sync_stats"]["rollbacks"] == 4
    stats = ref[-1]["sync_stats"]  # embedding, layers.0, layers.1, output
    assert stats["syncs"] == 4 and stats["rollbacks"] == 4
    assert stats["flagged site0"] == stats["flagged site1"] == 4 and stats["flagged"] == 8
    assert 0 < stats["min weight"] < 0.5  # the weighting is active: the sites' norms differ
    last_stage = records[-1]["sync_stats"]  # layers.1, output, and the tied copy's decision
    assert last_stage["rollbacks"] == 3 and last_stage["flagged"] == 6


@pytest.mark.slow
def test_blown_up_site_is_flagged_and_excluded_where_plain_averaging_degrades():
    # 3 sites x 1 rank, H = 2: 12 syncs; at sync 9 site 1's pseudo-gradient is 100x too large.
    base = COMMON + ["--num-sites", "3", "--global-batch-size", "12", "--train-iters", "24", "--lr", "3e-3",
                     "--log-interval", "4", "--eval-interval", "24", "--eval-iters", "8",
                     "--lsgd-algorithm", "edit", "--lsgd-interval", "2",
                     # the outer Nesterov step of the paper: it carries the blow-up into the later
                     # syncs too, which is what the penalty must keep out (plain averaging forgets it)
                     "--lsgd-outer-lr", "0.7", "--lsgd-outer-momentum", "0.9"]
    detector = ["--lsgd-edit-ema-warmup", "3"]
    fault = ["--lsgd-edit-inject-fault", "1:9:100"]
    clean = run_distributed(base + detector, 3)
    penalty = run_distributed(base + detector + fault, 3)
    penalty_prefetch = run_distributed(base + detector + fault + ["--lsgd-edit-prefetch", "3"], 3)
    plain = run_distributed(base + fault + ["--lsgd-edit-penalty", "none"], 3)
    loss = {name: r[-1]["valid"][-1] for name, r in (("clean", clean), ("penalty", penalty), ("plain", plain))}
    stats = penalty[-1]["sync_stats"]
    assert stats["flagged site1"] == 4 and stats["flagged"] == 4 and stats["rollbacks"] == 0  # 4 units, once
    assert clean[-1]["sync_stats"]["flagged"] == 0
    assert abs(loss["penalty"] / loss["clean"] - 1) < 0.01, loss
    assert loss["plain"] > 1.5 * loss["clean"], loss
    assert_same_run(penalty, penalty_prefetch)  # prefetch changes when data moves, not what it is
    for records in (clean, penalty, plain):
        assert_replicas_identical(records)
    assert merge_full_params(clean).keys() == merge_full_params(penalty).keys()


@pytest.mark.slow
def test_edit_and_a_edit_evaluate_the_synced_model_at_a_sync_boundary(monkeypatch):
    """diloco evaluates its anchor after a round; edit's sync at that boundary is decided but
    would only move in the next forward, and a-edit's too (here its sites take one virtual
    second per step and meet every 2 s, so it syncs where edit with H = 2 does). The loop
    evaluates after iterations 2, 4 and 6; quiesce() carries the due sync out first."""
    from megatron_lsgd.core.lsgd.algorithms.edit.a_edit import VIRTUAL_CLOCK_ENV

    monkeypatch.setenv(VIRTUAL_CLOCK_ENV, "1,1")  # read by a-edit only
    base = COMMON + LAYOUTS["sites2"][1] + ["--eval-iters", "1", "--eval-interval", "2", "--lsgd-outer-lr", "1",
                                            "--lsgd-outer-momentum", "0"]
    plain = ["--lsgd-edit-penalty", "none"]
    diloco, edit, a_edit = run_distributed_many([
        base + ["--lsgd-algorithm", "diloco", "--lsgd-interval", "2"],
        base + ["--lsgd-algorithm", "edit", "--lsgd-interval", "2"] + plain,
        base + ["--lsgd-algorithm", "a-edit", "--lsgd-aedit-interval-seconds", "2"] + plain], 2)
    assert logged_losses(edit) == logged_losses(diloco)  # the same training
    want = diloco[-1]["valid"]
    assert len(want) == 3
    assert edit[-1]["valid"] == want, "edit evaluated something other than the synced model"
    assert a_edit[-1]["valid"] == want, "a-edit evaluated something other than the synced model"
    for run in (edit, a_edit):
        assert run[-1]["sync_stats"]["syncs"] == 3
        assert_replicas_identical(run)
