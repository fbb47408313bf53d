"""tools/benchmarks/resumable_runs.py: a benchmark run stopped midway resumes from its last
checkpoint and reports what one uninterrupted run reports (curve, final loss, inter-site
counters), and the joining of segments on its own, by hand."""

from __future__ import annotations

import os

import pytest

from tools.benchmarks import resumable_runs
from tools.benchmarks.resumable_runs import Segment, WorkDir, joined, segment_argv


def _record(iteration, loss, sent, wall):
    return {"iteration": iteration, "interval_iters": 10, "losses": {"lm loss": loss}, "wall_s": wall,
            "inter_site_totals": {"bytes_sent": sent, "bytes_received": sent, "exposed_seconds": sent / 100,
                                  "rounds": sent // 10}}


def test_segments_join_up_to_where_the_next_one_resumed():
    # segment 1 saved at 20 and was stopped after logging 30 (redone by segment 2, which
    # resumed at 20); segment 2 stopped before its first checkpoint (nothing kept); segment 3
    # resumed at 20 again and finished
    first = Segment(0, [_record(10, 5.0, 100, 1.0), _record(20, 4.0, 200, 2.0), _record(30, 3.9, 300, 3.0)])
    second = Segment(20, [_record(30, 3.9, 100, 1.5)])
    last = Segment(20, [_record(30, 3.9, 100, 1.2), _record(40, 3.5, 250, 2.4)])
    final = {"train": [3.9, 3.5], "valid": [3.4], "seconds": 2.5, "tokens_per_s": 9.0,
             "comm": {"bytes_sent": 250, "bytes_received": 250, "exposed_seconds": 2.5, "rounds": 25}}
    out = joined([first, second, last], final)
    assert out["train"] == [5.0, 4.0, 3.9, 3.5]
    assert out["comm"] == {"bytes_sent": 450, "bytes_received": 450, "exposed_seconds": 4.5, "rounds": 45}
    assert out["seconds"] == pytest.approx(2.0 + 2.5) and out["segments"] == 3
    assert out["valid"] == [3.4] and out["tokens_per_s"] == 9.0
    assert joined([last], final) is final  # one piece: as it is


def test_a_checkpoint_between_logged_intervals_is_refused():
    first = Segment(0, [_record(10, 5.0, 100, 1.0)])
    with pytest.raises(RuntimeError, match="no logged interval ends at iteration 15"):
        joined([first, Segment(15, [])], {"train": [], "comm": {}, "seconds": 0.0})


def test_a_run_that_sets_its_own_checkpoints_is_refused():
    with pytest.raises(ValueError, match="--save"):
        segment_argv(["--save", "x"], ["--load", "y"])


@pytest.mark.slow
def test_a_stopped_run_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch):
    """diloco over 2 sites, 60 steps: once whole, once stopped at step 30 after a checkpoint at
    20 (the work after it thrown away, as a kill would) and run again. Resumption is bit-exact,
    so the joined result must equal the whole one: every logged loss, the final validation
    loss, and the inter-site counters."""
    from tools.benchmarks.quality.lsgd_quality import _run_once, base_argv, run

    monkeypatch.setattr(resumable_runs, "SAVE_INTERVAL", 20)
    argv = base_argv(num_layers=2, hidden_size=32, seq_length=32, global_batch_size=8, train_iters=60, lr=1e-3,
                     eval_interval=0, eval_iters=2, sites=2, data=["--mock-data", "--vocab-size", "512"],
                     extra=["--micro-batch-size", "2", "--lsgd-algorithm", "diloco", "--lsgd-interval", "15"])
    whole = run(argv, 2)
    work_dir = str(tmp_path / "cell")
    work = WorkDir(work_dir)
    _run_once(segment_argv(argv, work.begin_segment("first")) + ["--exit-interval", "30"], 2)
    assert resumable_runs.checkpointed_iteration(work.ckpt) == 30
    with open(os.path.join(work.ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("20")  # as if killed after logging step 30, before its save
    resumed = run(argv, 2, work_dir=work_dir)
    assert resumed["segments"] == 2 and not os.path.exists(work_dir)
    assert resumed["train"] == whole["train"] and len(whole["train"]) == 6
    assert resumed["valid"] == whole["valid"]
    for key in ("bytes_sent", "bytes_received", "rounds"):
        assert resumed["comm"][key] == whole["comm"][key] > 0, key
    assert resumed["segment_codes"][0] == "first"
