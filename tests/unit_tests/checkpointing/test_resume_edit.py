"""edit and a-edit resume bit-exactly.

- edit, killed with SIGKILL after a checkpoint taken at a step boundary where a sync is due
  (decided: norms gathered, sites weighed; its data would move in the next forward): the save
  carries the sync out first, so both sites' saved models are the same synced model; the
  run resumes and reproduces the uninterrupted run's losses and final checkpoint bit for bit;
- a-edit (sites at different speeds, on the deterministic virtual clock) pauses mid-interval
  at --exit-duration-in-mins, at a meeting where no sync is due; the resumed run continues
  each site from its own step, sample position and LR schedule, the interval's elapsed
  time included, and reproduces the uninterrupted run per site, to the same final
  checkpoint. The uninterrupted run meets its budget exactly, the fast site taking twice
  the slow site's steps; a start from its final checkpoint takes no step.
"""

from __future__ import annotations

import os
import re

import pytest

from megatron_lsgd.core.lsgd.algorithms.edit.a_edit import VIRTUAL_CLOCK_ENV
from megatron_lsgd.training.checkpointing.checkpointer import HOLD_ENV
from tests.unit_tests.checkpointing.launch import TINY, assert_same, kill, load_tree, run, start_forked, wait_for
from tests.unit_tests.checkpointing.test_resume_exact import _check_resumed, _tracker

SITE_LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.E+-]+) \|.*?\| site: (\d+) \|")


def run_env(args, nproc, log_path, env, timeout=180.0):
    return run(args, nproc, log_path, timeout=timeout, env=env)


@pytest.mark.slow
def test_edit_resumes_exactly_from_a_checkpoint_with_a_sync_due(tmp_path):
    # H = 2: the checkpoint at iteration 4 closes round 2, whose sync would run in step 5's
    # forward; the save carries it out (quiesce) with the same numbers.
    layout = ["--num-sites", "2", "--use-distributed-optimizer", "--global-batch-size", "8",
              "--hidden-dropout", "0", "--attention-dropout", "0", "--lsgd-algorithm", "edit",
              "--lsgd-interval", "2", "--lsgd-compression", "int8", "--lsgd-edit-ema-warmup", "2",
              "--lsgd-outer-momentum", "0.5"]
    common = TINY + layout + ["--train-iters", "8", "--save-interval", "4"]
    run_env(common + ["--save", str(tmp_path / "ref")], 4, str(tmp_path / "ref.log"), {})
    ckpt = str(tmp_path / "ckpt")
    proc = start_forked(common + ["--save", ckpt], 4, str(tmp_path / "killed.log"), env={HOLD_ENV: "8"})
    wait_for(lambda: os.path.exists(os.path.join(ckpt, ".holding_8")), proc, str(tmp_path / "killed.log"))
    kill(proc)
    assert _tracker(ckpt) == 4
    saved = load_tree(os.path.join(ckpt, "iter_0000004"))
    models = sorted(k for k in saved if os.path.basename(k).startswith("model_site_"))
    assert [os.path.basename(k) for k in models] == ["model_site_000.pt", "model_site_001.pt"]
    assert_same(saved[models[0]], saved[models[1]], "the sites' saved models (synced at the boundary)")
    run_env(common + ["--save", ckpt, "--load", ckpt], 4, str(tmp_path / "resumed.log"), {})
    _check_resumed(tmp_path, str(tmp_path / "ref.log"), str(tmp_path / "resumed.log"), 4)


def site_losses(text):
    out = {}
    for it, loss, site in SITE_LOSS.findall(text):
        out.setdefault(int(site), {})[int(it)] = loss
    return out


@pytest.mark.slow
def test_a_edit_pauses_mid_interval_and_resumes_exactly(tmp_path):
    # Site 0 takes 1 (virtual) second per step, site 1 two; syncs every 4 s; 96 samples = 24
    # site steps: meetings after site steps (4, 2), (8, 4), (12, 6) and, on quotas, (16, 8).
    env = {VIRTUAL_CLOCK_ENV: "1,2"}
    common = TINY + ["--num-sites", "2", "--use-distributed-optimizer", "--global-batch-size", "8",
                     "--hidden-dropout", "0", "--attention-dropout", "0", "--lsgd-algorithm", "a-edit",
                     "--lsgd-aedit-interval-seconds", "4", "--lsgd-compression", "int8",
                     "--lsgd-edit-ema-warmup", "2", "--train-iters", "12"]
    ref = run_env(common + ["--save", str(tmp_path / "ref")], 4, str(tmp_path / "ref.log"), env)
    assert "training ends at iteration 16 of site 0" in ref and "training ends at iteration 8 of site 1" in ref
    assert "(96 consumed, site steps 16/8)" in ref

    # 6 virtual seconds: site 0 after step 6, site 1 after step 3, half-way through interval 2.
    ckpt = str(tmp_path / "ckpt")
    paused = run_env(common + ["--save", ckpt, "--exit-duration-in-mins", "0.1"], 4, str(tmp_path / "paused.log"),
                     env)
    assert "exiting at iteration 6" in paused and "exiting at iteration 3" in paused
    assert _tracker(ckpt) == (6 + 3) * 4 // 8  # named by the job's progress in global batches
    resumed = run_env(common + ["--save", ckpt, "--load", ckpt], 4, str(tmp_path / "resumed.log"), env)

    want, got = site_losses(ref), site_losses(resumed)
    assert sorted(got[0]) == list(range(7, 17)) and sorted(got[1]) == list(range(4, 9))
    for site in (0, 1):
        for it, loss in got[site].items():
            assert loss == want[site][it], f"site {site} iteration {it}: resumed {loss} vs {want[site][it]}"
    final = "iter_0000012"
    assert_same(load_tree(str(tmp_path / "ref" / final)), load_tree(os.path.join(ckpt, final)), final)

    # The job has ended: a start from its final checkpoint takes no step and saves nothing (the
    # meeting loop has the checkpoint's `ended` restored).
    again = run_env(common + ["--save", ckpt, "--load", ckpt], 4, str(tmp_path / "again.log"), env)
    assert not SITE_LOSS.search(again) and " saved checkpoint" not in again, again[-2000:]
    assert "done: 16 iterations on site 0" in again and "done: 8 iterations on site 1" in again
