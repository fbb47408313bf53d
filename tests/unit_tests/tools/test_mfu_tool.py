"""tools/benchmarks/step/mfu.py runs end to end on its smoke preset (CPU here; the ~1B preset is
for GPUs, tools/gpu_check.sh) and its MFU is tokens/s x model FLOPs per token / peak."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
import torch.distributed as dist

from megatron_lsgd.training.compat_runtime import flops_per_sample
from tests.unit_tests.harness import free_port


def test_mfu_smoke_preset(monkeypatch, tmp_path):
    from tools.benchmarks.step import mfu

    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "mfu.json"
    try:
        result = mfu.main(["--preset", "smoke", "--steps", "1", "--rounds", "1", "--peak-tflops", "0.001",
                           "--json", str(out), "--profile", "5"])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert json.loads(out.read_text()) == result
    assert result["ours_tokens_per_s"] > 0 and result["plain_tokens_per_s"] > 0
    assert result["parameters"] > 0 and result["preset"] == "smoke"
    shares = result["profile"]  # fractions of the profiled steps' wall time, each counted once
    assert set(shares) == {"matmul", "attention", "optimizer"}
    assert all(0 < v < 1 for v in shares.values()) and sum(shares.values()) < 1
    from megatron_lsgd.core.transformer.config import TransformerConfig

    c = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                          ffn_hidden_size=128, seq_length=64, swiglu=True)
    per_token = flops_per_sample(c, 256) / 64  # vocab 256 is already a multiple of 128
    for name in ("ours", "plain"):
        expected = result[f"{name}_tokens_per_s"] * per_token / 1e9
        assert abs(result[f"{name}_mfu"] - expected) <= 1e-9 * expected


def _one_rank_env(monkeypatch):
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(k, v)


def _run_mfu(monkeypatch, argv):
    """mfu.main(argv) as a one-rank world, its process group torn down after."""
    from tools.benchmarks.step import mfu

    _one_rank_env(monkeypatch)
    try:
        return mfu.main(argv)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.slow
def test_mfu_compiled_loops_report_compile_time_and_counts(monkeypatch, tmp_path):
    # --compile: both loops' layers compiled (inductor on CPU), the first step's extra time and
    # dynamo's counts reported; --no-plain: our loop alone, no ratio
    result = _run_mfu(monkeypatch, ["--preset", "smoke", "--steps", "1", "--rounds", "1", "--compile"])
    assert result["compile"] and result["fits"]
    # one graph per loop (ours in bf16 parameters, the plain loop's fp32 under autocast), no break
    assert result["compile_counts"]["graphs"] == 2 and result["compile_counts"]["graph_breaks"] == 0
    assert result["ours_first_step_extra_s"] > 0 and result["plain_first_step_extra_s"] > 0
    alone = _run_mfu(monkeypatch, ["--preset", "smoke", "--steps", "1", "--rounds", "1", "--no-plain"])
    assert "plain_tokens_per_s" not in alone and "ratio" not in alone and alone["ours_tokens_per_s"] > 0
    assert alone["parameters"] == result["parameters"]


def test_mfu_reports_running_out_of_memory_as_not_fitting(monkeypatch, tmp_path):
    from tools.benchmarks.step import mfu

    def out_of_memory(*_):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    monkeypatch.setattr(mfu, "measure", out_of_memory)
    out = tmp_path / "oom.json"
    result = mfu.main(["--preset", "8b", "--recompute", "full", "--no-plain", "--json", str(out)])
    assert result["fits"] is False and result["error"] == "CUDA out of memory. Tried to allocate 2.00 GiB"
    assert json.loads(out.read_text()) == result


def test_largest_micro_batch_stops_at_the_first_size_that_does_not_fit(monkeypatch, tmp_path):
    from tools.benchmarks.step import mfu

    sizes = []

    def fake_run(cmd, **_):  # a child that fits up to micro-batch 4
        size = int(cmd[cmd.index("--micro-batch-size") + 1])
        sizes.append(size)
        assert "--no-plain" in cmd and "--compile" in cmd
        fits = size <= 4
        with open(cmd[cmd.index("--json") + 1], "w") as f:
            json.dump({"fits": fits, "error": None if fits else "CUDA out of memory"}, f)
        return subprocess.CompletedProcess(cmd, 0, "")

    monkeypatch.setattr(mfu.subprocess, "run", fake_run)
    result = mfu.main(["--preset", "smoke", "--largest-micro-batch", "64", "--compile"])
    assert sizes == [1, 2, 4, 8] and result["largest_micro_batch"] == 4
    assert result["micro_batch_tries"][8] == {"fits": False, "error": "CUDA out of memory",
                                              "peak_cuda_allocated_mb": None}
    with pytest.raises(SystemExit):
        mfu.main(["--preset", "smoke", "--largest-micro-batch", "4", "--micro-batch-size", "2"])


@pytest.mark.slow
def test_largest_micro_batch_runs_each_size_in_a_fresh_process(tmp_path):
    from tools.benchmarks.step import mfu

    result = mfu.main(["--preset", "smoke", "--largest-micro-batch", "2", "--json", str(tmp_path / "m.json")])
    assert result["largest_micro_batch"] == 2 and all(t["fits"] for t in result["micro_batch_tries"].values())


def test_clock_cost_reads_the_clock_where_each_mode_says(monkeypatch):
    # tools/benchmarks/step/clock_cost.py: its figures mean something only if 'per step' and 'per layer'
    # really read the clock that often (on the host the readings are free, so the times can't tell)
    from tools.benchmarks.step import clock_cost

    readings = []

    class CountingClock(clock_cost.Clock):
        def now(self):
            readings.append(1)
            return super().now()

    monkeypatch.setattr(clock_cost, "Clock", CountingClock)
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(k, v)
    try:
        result = clock_cost.main(["--preset", "smoke", "--steps", "1", "--rounds", "1"])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert set(result) == set(clock_cost.MODES) and all(v > 0 for v in result.values())
    # the clock's start (1); 2 warm-up + 1 timed steps per mode: none 0, per step 3, per layer 3 x (2 layers + 1)
    assert len(readings) == 1 + 0 + 3 + 3 * 3


def test_gpu_check_report_reads_the_mfu_json_and_marks_the_targets(tmp_path):
    # tools/gpu_check.sh's throughput and memory lines (tools/benchmarks/step/gpu_report.py), from
    # files in the shape mfu.py writes; the figures here are made up for the test, not measured
    from tools.benchmarks.step.gpu_report import throughput_and_memory

    def write(name, **fields):
        (tmp_path / f"mfu_{name}.json").write_text(json.dumps(fields))

    base = dict(parameters=1.1e9, preset="1b", seq_length=2048, micro_batch_size=4, peak_cuda_allocated_mb=50000)
    write("eager", **base, plain_tokens_per_s=100.0, ours_tokens_per_s=103.0, plain_mfu=0.30, ours_mfu=0.31,
          plain_first_step_extra_s=1.0, ours_first_step_extra_s=1.0, ratio=1.03)
    write("compiled", **base, plain_tokens_per_s=110.0, ours_tokens_per_s=112.0, plain_mfu=0.44, ours_mfu=0.46,
          plain_first_step_extra_s=30.0, ours_first_step_extra_s=31.0, compile_counts={"graphs": 2})
    write("mbs_eager", preset="1b", largest_micro_batch=8,
          micro_batch_tries={"1": {"fits": True}, "2": {"fits": True}, "4": {"fits": True}, "8": {"fits": True},
                             "16": {"fits": False, "error": "CUDA out of memory"}})
    write("mbs_compiled", preset="1b", largest_micro_batch=16, micro_batch_tries={"16": {"fits": True}})
    write("8b_full", fits=False, error="CUDA out of memory. Tried to allocate 3.9 GiB")
    text = "\n".join(throughput_and_memory(str(tmp_path), "0", "0", "1"))
    assert "| megatron_lsgd | compiled | 112 | 0.460 | 31.0 | 50000 |" in text
    # 112 / 110 = 1.018 >= 1.0; 112 / 100 = 1.12 < 1.15; 0.46 >= 0.45
    assert "compiled plain: 1.018 (target >= 1.0: met)" in text
    assert "eager plain: 1.120 (target >= 1.15: MISSED)" in text and "(target >= 0.45: met)" in text
    assert "(1b preset, eager): 8 of 1, 2, 4, 8, 16; 16 did not fit: CUDA out of memory" in text
    assert "8B shape with --recompute-granularity full: does not fit: CUDA out of memory. Tried" in text
    failed = "\n".join(throughput_and_memory(str(tmp_path), "1", "0", "0"))
    assert "mfu.py FAILED (exit 1)" in failed and "Memory headroom" not in failed
    # and each target can be missed: MFU below 0.45, behind the compiled plain loop
    write("compiled", **base, plain_tokens_per_s=120.0, ours_tokens_per_s=118.0, plain_mfu=0.41, ours_mfu=0.40,
          plain_first_step_extra_s=30.0, ours_first_step_extra_s=31.0, compile_counts={"graphs": 2})
    missed = "\n".join(throughput_and_memory(str(tmp_path), "0", "0", "0"))
    assert "compiled plain: 0.983 (target >= 1.0: MISSED)" in missed and "MFU 0.400 (target >= 0.45: MISSED)" in missed
