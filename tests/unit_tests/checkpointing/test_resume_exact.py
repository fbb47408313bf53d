"""Killed with SIGKILL after (or during) a save and resumed, a run reproduces the
uninterrupted run bit for bit: the same printed losses and the same final weights,
optimizer shards and RNG states."""

from __future__ import annotations

import os

import pytest

from tests.unit_tests.checkpointing.launch import (TINY, assert_same, kill, load_tree, losses, read, run,
                                                   start_forked, wait_for)
from megatron_lsgd.training.checkpointing.checkpointer import HOLD_ENV

ITERS = 8


def _tracker(save_dir: str):
    path = os.path.join(save_dir, "latest_checkpointed_iteration.txt")
    return int(open(path).read()) if os.path.exists(path) else None


def _check_resumed(tmp_path, ref_log: str, resumed_log: str, start_iter: int) -> None:
    ref, resumed = losses(read(ref_log)), losses(read(resumed_log))
    assert sorted(ref) == list(range(1, ITERS + 1))
    assert sorted(resumed) == list(range(start_iter + 1, ITERS + 1)), "the resumed run restarts after the checkpoint"
    for it in resumed:
        assert resumed[it] == ref[it], f"iteration {it}: resumed {resumed[it]} vs uninterrupted {ref[it]}"
    final = f"iter_{ITERS:07d}"
    assert_same(load_tree(str(tmp_path / "ref" / final)), load_tree(str(tmp_path / "ckpt" / final)), final)


@pytest.mark.slow
def test_tp2_pp2_sigkill_after_checkpoint(tmp_path):
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
              "--global-batch-size", "4", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    common = TINY + layout + ["--lr-decay-iters", str(ITERS), "--save-interval", "2"]
    run(common + ["--train-iters", str(ITERS), "--save", str(tmp_path / "ref")], 4, str(tmp_path / "ref.log"))

    # A long run, killed as soon as a checkpoint exists (its schedule is that of ITERS).
    ckpt = str(tmp_path / "ckpt")
    proc = start_forked(common + ["--train-iters", "1000", "--save", ckpt], 4, str(tmp_path / "killed.log"))
    wait_for(lambda: _tracker(ckpt) is not None, proc, str(tmp_path / "killed.log"))
    kill(proc)
    k = _tracker(ckpt)
    assert k is not None and k < ITERS

    run(common + ["--train-iters", str(ITERS), "--save", ckpt, "--load", ckpt], 4, str(tmp_path / "resumed.log"))
    _check_resumed(tmp_path, str(tmp_path / "ref.log"), str(tmp_path / "resumed.log"), k)


@pytest.mark.slow
def test_sites2_zero1_sigkill_during_save_keeps_previous_checkpoint(tmp_path):
    layout = ["--num-sites", "2", "--use-distributed-optimizer", "--ddp-bucket-size", "3000",
              "--global-batch-size", "8", "--hidden-dropout", "0", "--attention-dropout", "0"]
    common = TINY + layout + ["--train-iters", str(ITERS), "--save-interval", "2"]
    run(common + ["--save", str(tmp_path / "ref")], 4, str(tmp_path / "ref.log"))

    # The save of iteration 4 stops after writing every file, just before its commit.
    ckpt = str(tmp_path / "ckpt")
    proc = start_forked(common + ["--save", ckpt], 4, str(tmp_path / "killed.log"), env={HOLD_ENV: "4"})
    wait_for(lambda: os.path.exists(os.path.join(ckpt, ".holding_4")), proc, str(tmp_path / "killed.log"))
    kill(proc)
    assert _tracker(ckpt) == 2, "the tracker still names the previous checkpoint"
    assert not os.path.exists(os.path.join(ckpt, "iter_0000004"))
    assert os.path.isdir(os.path.join(ckpt, ".iter_0000004.partial")), "the interrupted save was under way"

    text = run(common + ["--save", ckpt, "--load", ckpt], 4, str(tmp_path / "resumed.log"))
    assert "loaded checkpoint" in text and "iter_0000002" in text
    _check_resumed(tmp_path, str(tmp_path / "ref.log"), str(tmp_path / "resumed.log"), 2)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["diloco", "dilocox", "dilocox-apply-step"])
def test_local_sgd_state_survives_sigkill(tmp_path, algorithm):
    """Anchors, outer momentum, error feedback and the in-flight mean come back exactly:
    H = 3 and a checkpoint at iteration 4 is mid-round, with dilocox's compressed mean of
    round 1 still to be applied (at the round's end, or with apply-step 2 one step after
    the resume)."""
    layout = ["--num-sites", "2", "--use-distributed-optimizer", "--global-batch-size", "8",
              "--hidden-dropout", "0", "--attention-dropout", "0",
              "--lsgd-algorithm", algorithm.split("-")[0], "--lsgd-interval", "3",
              "--lsgd-outer-lr", "0.7", "--lsgd-outer-momentum", "0.9"]  # a momentum to restore
    if algorithm.startswith("dilocox"):
        layout += ["--lsgd-compression", "int4"]
    if algorithm == "dilocox-apply-step":
        layout += ["--lsgd-dilocox-apply-step", "2"]
    common = TINY + layout + ["--train-iters", str(ITERS), "--save-interval", "4"]
    run(common + ["--save", str(tmp_path / "ref")], 4, str(tmp_path / "ref.log"))

    # Hold the save of iteration 8 so the kill always lands after checkpoint 4.
    ckpt = str(tmp_path / "ckpt")
    proc = start_forked(common + ["--save", ckpt], 4, str(tmp_path / "killed.log"), env={HOLD_ENV: "8"})
    wait_for(lambda: os.path.exists(os.path.join(ckpt, ".holding_8")), proc, str(tmp_path / "killed.log"))
    kill(proc)
    assert _tracker(ckpt) == 4

    run(common + ["--save", ckpt, "--load", ckpt], 4, str(tmp_path / "resumed.log"))
    _check_resumed(tmp_path, str(tmp_path / "ref.log"), str(tmp_path / "resumed.log"), 4)
