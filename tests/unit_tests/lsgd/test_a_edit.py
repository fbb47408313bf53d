"""a-edit with a straggler (--simulate-slow-ranks) on the simulated clock, so that the load of
the machine cannot change the outcome: the fast site takes more steps than the slow one, the
sites use the token budget (to within one global batch) and end with the same model; every
site logs its own steps."""

from __future__ import annotations

import pytest

from tests.unit_tests.harness import assert_replicas_identical, run_distributed
from tests.unit_tests.lsgd.test_algorithms import COMMON


@pytest.mark.slow
def test_a_edit_lets_the_fast_site_step_ahead_of_a_straggler():
    # site 1 is 4x slower; 30 global batches of 8 = 60 site steps of 4 samples, synced every
    # 0.3 simulated s (a step: 2 micro-batches of 0.05 s and a 0.005 s optimizer step, x4 on site 1)
    records = run_distributed(COMMON + [
        "--num-sites", "2", "--train-iters", "30", "--lr", "5e-3", "--lsgd-algorithm", "a-edit",
        "--lsgd-aedit-interval-seconds", "0.3", "--simulate-slow-ranks", "1", "--slow-factor", "4",
        "--simulate-clock"], 2)
    fast, slow = (len(r["losses"]) for r in records)  # --log-interval 1: one line per own step
    # training ends with less than one global batch (two site steps) of the budget left; the
    # final interval's quotas normally use it exactly
    assert fast + slow in (59, 60), (fast, slow)
    assert fast >= 2 * slow, (fast, slow)
    assert_replicas_identical(records)
    stats = records[0]["sync_stats"]
    assert stats["syncs"] >= 2 and stats["meetings"] >= stats["syncs"]
    assert records[0]["comm"]["bytes_sent"] > 0


@pytest.mark.slow
def test_a_fast_site_follows_the_jobs_lr_schedule_and_logs_its_own_cap(tmp_path):
    """Virtual clock: site 0 steps in 1 s, site 1 in 2 s, meetings every 4 s; 12 global
    batches = 24 site steps, 16 taken by site 0. Counting its own steps, site 0 ended its
    decay at step 12 and ran steps 12-16 at --min-lr (and logged "iteration 16/ 12"); it
    now follows the job's agreed progress, which reaches 12 only at the end."""
    import re

    from megatron_lsgd.core.lsgd.algorithms.edit.a_edit import VIRTUAL_CLOCK_ENV
    from tests.unit_tests.checkpointing.launch import TINY
    from tests.unit_tests.checkpointing.test_resume_edit import run_env

    text = run_env(TINY + ["--num-sites", "2", "--global-batch-size", "8", "--lsgd-algorithm", "a-edit",
                           "--lsgd-aedit-interval-seconds", "4", "--train-iters", "12"], 2,
                   str(tmp_path / "run.log"), {VIRTUAL_CLOCK_ENV: "1,2"})
    line = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?learning rate: ([0-9.E+-]+) \|.*?\| site: (\d+) \| "
                      r"job iteration: (\d+)/12 \|")
    lr = {(int(site), int(it)): float(rate) for it, _cap, rate, site, _job in line.findall(text)}
    caps = {int(cap) for _it, cap, _rate, _site, _job in line.findall(text)}
    assert max(it for site, it in lr if site == 0) == 16 and caps == {24}  # at most the whole budget, 24 site steps
    assert lr[(0, 13)] > lr[(0, 14)] > 1e-4  # still decaying (was --min-lr 1e-4 from step 12 on)
    assert lr[(1, 8)] == pytest.approx(1e-4, rel=0.05)  # the slow site reaches the end of the decay too
