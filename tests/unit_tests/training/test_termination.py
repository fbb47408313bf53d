"""Runs that end without a fixed iteration count: a token budget ends training (the
synchronizer closes its round, every site ends with the same model); a wall-clock limit
pauses every rank of every site at the same iteration with a checkpoint, and the resumed
run continues bit-exactly."""

from __future__ import annotations

import os
import re

import pytest

from tests.unit_tests.checkpointing.launch import TINY, assert_same, load_tree, losses, run
from tests.unit_tests.harness import assert_replicas_identical, run_distributed


@pytest.mark.slow
def test_token_budget_ends_training_and_closes_the_round():
    # 2 sites x 2 samples x 32 tokens per step: 7.9 steps' worth of tokens -> 7 iterations
    tokens = int(7.9 * 4 * 32)
    argv = [a for a in TINY if a != "--distributed-backend" and a != "gloo"]
    records = run_distributed(argv + ["--num-sites", "2", "--global-batch-size", "4", "--train-tokens", str(tokens),
                                      "--lsgd-algorithm", "diloco", "--lsgd-interval", "3",
                                      "--hidden-dropout", "0", "--attention-dropout", "0"], 2)
    assert len(records[-1]["losses"]) == 7
    assert records[-1]["sync_stats"]["outer rounds"] == 3  # rounds of 3, 3 and the closing 1
    assert_replicas_identical(records)


@pytest.mark.slow
def test_exit_duration_pauses_every_site_at_one_iteration_and_resumes_exactly(tmp_path):
    common = TINY + ["--num-sites", "2", "--global-batch-size", "4", "--hidden-dropout", "0",
                     "--attention-dropout", "0", "--lr-decay-style", "constant", "--lr-warmup-iters", "0",
                     "--lsgd-algorithm", "dilocox", "--lsgd-interval", "4", "--lsgd-compression", "int4"]
    ckpt = str(tmp_path / "ckpt")
    # On the simulated clock a step costs exactly 1 s, whatever the machine's load: 4.8 s are
    # up after step 5, which every rank learns one step late, so every rank stops after step 6.
    simulated = ["--simulate-clock", "--simulate-microbatch-seconds", "1", "--simulate-optimizer-step-seconds", "0"]
    text = run(common + simulated + ["--train-iters", "100000", "--exit-duration-in-mins", "0.08", "--save", ckpt], 2,
               str(tmp_path / "timed.log"))
    stop = re.search(r"exiting at iteration (\d+) \(--exit-duration-in-mins 0.08: ([0-9.]+) min elapsed\)", text)
    assert stop, text[-2000:]
    k = int(stop.group(1))
    assert k == 6 and stop.group(2) == "0.08"
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        assert int(f.read()) == k  # every rank of both sites saved at the same iteration

    end = k + 3
    resumed = run(common + ["--train-iters", str(end), "--save", ckpt, "--load", ckpt], 2,
                  str(tmp_path / "resumed.log"))
    ref = run(common + ["--train-iters", str(end), "--save", str(tmp_path / "ref")], 2, str(tmp_path / "ref.log"))
    got, want = losses(resumed), losses(ref)
    assert sorted(got) == list(range(k + 1, end + 1))
    assert all(got[i] == want[i] for i in got), "the resumed run differs from the uninterrupted one"
    final = f"iter_{end:07d}"
    assert_same(load_tree(os.path.join(ckpt, final)), load_tree(str(tmp_path / "ref" / final)), final)
