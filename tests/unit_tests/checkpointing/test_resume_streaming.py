"""streaming-diloco and cocodc resume bit-exactly after SIGKILL, from a checkpoint saved while
a fragment's all-reduce was in flight (quiesce() drains it; the mean is applied at its usual
step after the resume): per-fragment anchors, momenta, error feedback (low-rank warm starts
for cocodc), CoCoDC's start snapshots, R_p and schedule position all come back."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_lsgd.training.checkpointing.checkpointer import HOLD_ENV
from megatron_lsgd.training.checkpointing.layout import rank_file_name
from tests.unit_tests.checkpointing.launch import TINY, kill, run, start_forked, wait_for
from tests.unit_tests.checkpointing.test_resume_exact import ITERS, _check_resumed, _tracker

ALGORITHMS = {
    # 2 sites x 1 rank. H = 6, K = 2, τ = 2: fragment 1 starts after step 4 and lands after step 6, so the save of
    # iteration 4 catches its int4 mean in flight; fragment 0 is in flight again at --train-iters
    "streaming-diloco": ["--lsgd-algorithm", "streaming-diloco", "--lsgd-interval", "6", "--lsgd-fragments", "2",
                         "--lsgd-fragment-sync-delay", "2", "--lsgd-fragment-update-alpha", "0.5",
                         "--lsgd-compression", "int4"],
    # 2 sites x ZeRO-1 over 2 ranks. N = 3 syncs per H = 6 (a slot every 2 steps), τ = 1: one starts after step 4, lands after 5
    "cocodc": ["--lsgd-algorithm", "cocodc", "--lsgd-interval", "6", "--lsgd-fragments", "2",
               "--lsgd-fragment-sync-delay", "1", "--lsgd-cocodc-syncs-per-round", "3",
               "--lsgd-compression", "lowrank-int4", "--lsgd-rank", "2"],
}


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_streaming_state_survives_sigkill_with_a_fragment_in_flight(tmp_path, algorithm):
    world = 2 if algorithm == "streaming-diloco" else 4
    layout = ["--num-sites", "2", "--use-distributed-optimizer", "--global-batch-size", "8",
              "--hidden-dropout", "0", "--attention-dropout", "0", "--untie-embeddings-and-output-weights"]
    common = TINY + layout + ALGORITHMS[algorithm] + ["--train-iters", str(ITERS), "--save-interval", "4"]
    run(common + ["--save", str(tmp_path / "ref")], world, str(tmp_path / "ref.log"))

    ckpt = str(tmp_path / "ckpt")
    proc = start_forked(common + ["--save", ckpt], world, str(tmp_path / "killed.log"), env={HOLD_ENV: "8"})
    wait_for(lambda: os.path.exists(os.path.join(ckpt, ".holding_8")), proc, str(tmp_path / "killed.log"))
    kill(proc)
    assert _tracker(ckpt) == 4

    saved = torch.load(os.path.join(ckpt, "iter_0000004", "mp_rank_00", rank_file_name(0, 0)), weights_only=True)
    assert saved["synchronizer"]["in_flight"], "the save caught a fragment's all-reduce in flight"
    run(common + ["--save", ckpt, "--load", ckpt], world, str(tmp_path / "resumed.log"))
    _check_resumed(tmp_path, str(tmp_path / "ref.log"), str(tmp_path / "resumed.log"), 4)
