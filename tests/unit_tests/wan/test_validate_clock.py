"""tools/benchmarks/validate_clock.py without running anything: the comparison of real and
simulated time per step and ratio to the ceiling, and the 10% verdict."""

import pytest

from tools.benchmarks import validate_clock as vc
from tools.benchmarks.wan_report import CEILING


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
    # 10 MB each way; medians 1.02 s and 0.1 CPU s; the model charges 20 ms + bytes / rate
    rate, cpu = vc.link_keys(10_000_000, [1.5, 1.02, 0.9], [0.1, 0.3, 0.05], delay_ms=20)
    assert rate == pytest.approx(80.0) and cpu == pytest.approx(0.1 / 20)
    with pytest.raises(SystemExit, match="nothing was measured"):
        vc.link_keys(10, [0.01], [0.0], delay_ms=20)
