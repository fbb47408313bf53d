"""tools/benchmarks/wan/validate_clock.py without running anything: the comparison of real and
simulated time per step and ratio to the ceiling, and the 10% verdict."""

import pytest

from tools.benchmarks.wan import validate_clock as vc
from tools.benchmarks.wan.wan_report import CEILING


def run(updates_per_s):
    return {"updates_per_s": updates_per_s}


def test_each_repetition_is_compared_with_its_own_ceiling_and_the_median_is_taken():
    real = [{CEILING: run(4.0), "sync": run(1.0)}, {CEILING: run(2.0), "sync": run(0.8)},
            {CEILING: run(4.0), "sync": run(1.25)}]
    sim = {CEILING: run(4.0), "sync": run(1.05), "diloco": run(3.0)}  # diloco ran in no real repetition
    (row,) = vc.compare(real, sim)
    assert row["real_s"] == pytest.approx(1.0) and row["real_s_range"] == pytest.approx([0.8, 1.25])
    assert row["real_ratio"] == pytest.approx(0.3125)  # median of 0.25, 0.4, 0.3125
    assert row["predicted_s"] == pytest.approx(1 / 1.05) and row["error"] == pytest.approx(1 / 1.05 - 1)
    assert row["ratio_error"] == pytest.approx(1.05 / 4 / 0.3125 - 1)


def test_the_verdict_needs_both_columns_within_ten_percent():
    good = {"algorithm": "a", "real_s": 1.0, "real_s_range": [1.0, 1.0], "predicted_s": 1.05, "error": 0.05,
            "real_ratio": 0.5, "predicted_ratio": 0.52, "ratio_error": 0.04}
    bad = dict(good, algorithm="b", ratio_error=-0.2)
    lines = vc.table([good, bad], ["header"]).splitlines()
    assert lines[-2].endswith("| yes |") and lines[-1].endswith("| **no** |")


def test_the_collective_probe_gives_the_rate_at_which_the_link_model_takes_as_long_and_cpu_per_mb():
    # 10 MB each way; medians 1.02 s and 0.1 CPU s; the model charges 2 phases x 10 ms + bytes / rate
    rate, cpu = vc.link_keys(10_000_000, [1.5, 1.02, 0.9], [0.1, 0.3, 0.05], delay_ms=10)
    assert rate == pytest.approx(80.0) and cpu == pytest.approx(0.1 / 20)
    # the same with 2 one-way delays per phase (gloo after an idle gap): 2 x 2 x 5 ms
    rate, _ = vc.link_keys(10_000_000, [1.5, 1.02, 0.9], [0.1, 0.3, 0.05], delay_ms=5, delays=2.0)
    assert rate == pytest.approx(80.0)
    with pytest.raises(SystemExit, match="nothing was measured"):
        vc.link_keys(10, [0.04], [0.0], delay_ms=20)


def test_the_latency_probe_gives_one_way_delays_per_phase():
    # the 4 kB all-reduce over 60 ms: 0.244 s (median) is 4.07 delays over 2 phases
    assert vc.PHASES == 2
    assert vc.delays_per_phase([0.25, 0.244, 0.24], delay_ms=60) == pytest.approx(0.244 / 0.12)
    assert vc.delays_per_phase([0.01], delay_ms=0) == 1.0


def _site_log(path, seconds_per_step):
    import json
    import os

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for it in (2, 4, 6):  # the first interval is left out as warm-up
            f.write(json.dumps({"iteration": it, "interval_iters": 2, "elapsed_s": 2 * seconds_per_step,
                                "wall_s": it * seconds_per_step, "exposed_comm_s": 0.0,
                                "tokens": 2048, "losses": {"lm loss": 5.0}, "inter_site_bytes": 0}) + "\n")


def test_with_a_straggler_compute_is_calibrated_from_the_fast_site_alone(tmp_path):
    """The ceiling's updates/s is the mean of its sites', the slow one's included; the
    calibration takes site 0's own step from each repetition's log, median over them."""
    dirs = [str(tmp_path / f"real{i}") for i in range(3)]
    for d, step in zip(dirs, (0.5, 0.4, 0.45)):
        _site_log(f"{d}/logs/{CEILING}.site0.jsonl", step)
    real = [{CEILING: run(1.0)}] * 3  # what the ceiling's mean would say
    assert vc.calibration_step(real, dirs, slow=True) == pytest.approx(0.45)
    assert vc.calibration_step(real, dirs, slow=False) == pytest.approx(1.0)


def test_the_straggler_and_second_link_reach_every_run(tmp_path, monkeypatch, capsys):
    """A smoke run of the tool without namespaces: the real runs and the simulated one get the
    straggler and the link; the probes' delays per phase reach the simulated clock; the
    table's header names the scenario."""
    import json

    calls = []

    def fake_bench(out_dir, args, extra=""):
        calls.append((out_dir, extra))
        _site_log(f"{out_dir}/logs/{CEILING}.site0.jsonl", 0.5)
        slow = 0.95 if extra else 1.0  # the simulated run within 10%
        return {CEILING: run(1.5), "sync": run(slow), "edit": run(slow)}

    monkeypatch.setattr(vc, "bench", fake_bench)
    argv_seen = []
    monkeypatch.setattr(vc.wan_bench, "main", lambda argv: argv_seen.append(argv) or 0)
    monkeypatch.setattr(vc, "calibrate_link", lambda rate, delay, nbytes, repeats: (25.0, 0.004, 2.0))
    doc = tmp_path / "validation.md"
    assert vc.main(["--algorithms", "sync,edit", "--repeats", "2", "--train-iters", "8", "--log-interval", "2",
                    "--rate-mbit", "30", "--delay-ms", "60", "--slow-factor", "2", "--out-dir", str(tmp_path / "out"),
                    "--doc", str(doc)]) == 0
    assert len(calls) == 3 and not calls[0][1] and not calls[1][1]
    extra = calls[2][1]
    assert "--simulate-inter-site-delays-per-phase 2.0000" in extra and "--simulate-inter-site-latency 60" in extra
    assert "--simulate-inter-site-bandwidth 25.00" in extra
    optimizer = vc.OPTIMIZER_S_PER_PARAM * vc.PARAMS
    assert f"--simulate-microbatch-seconds {(0.5 - optimizer) / 2:.5f}" in extra  # site 0's step, not the mean
    text = doc.read_text()
    assert "--rate-mbit 30 --delay-ms 60 --slow-factor 2" in text and "site 1 2x slower" in text
    assert "2.00 one-way delays per phase" in text and text.count("| yes |") == 2
    saved = json.load(open(tmp_path / "out" / "validation.json"))
    assert saved["slow_factor"] == 2.0 and saved["delays_per_phase"] == 2.0
    # what bench passes wan_bench: the straggler in every run
    args = vc.argparse.Namespace(algorithms="sync", train_iters=8, log_interval=2, rate_mbit=30.0, delay_ms=60.0,
                                 algo_args=[], slow_factor=2.0)
    monkeypatch.undo()
    monkeypatch.setattr(vc.wan_bench, "main", lambda argv: argv_seen.append(argv) or 0)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "results.json").write_text(json.dumps({"runs": [{"algorithm": "sync"}]}))
    vc.bench(str(tmp_path / "b"), args, "--simulate-clock")
    assert argv_seen[-1][-4:] == ["--slow-ranks", "1", "--slow-factor", "2.0"]
    assert "--rate-mbit" in argv_seen[-1] and argv_seen[-1][argv_seen[-1].index("--delay-ms") + 1] == "60.0"
