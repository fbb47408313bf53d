"""tools/benchmarks/mfu.py runs end to end on its smoke preset (CPU here; the ~1B preset is
for GPUs, tools/gpu_check.sh) and its MFU is tokens/s x model FLOPs per token / peak."""

from __future__ import annotations

import json

import torch.distributed as dist

from megatron_lsgd.training.compat_runtime import flops_per_sample
from tests.unit_tests.harness import free_port


def test_mfu_smoke_preset(monkeypatch, tmp_path):
    from tools.benchmarks import mfu

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


def test_clock_cost_reads_the_clock_where_each_mode_says(monkeypatch):
    # tools/benchmarks/clock_cost.py: its figures mean something only if 'per step' and 'per layer'
    # really read the clock that often (on the host the readings are free, so the times can't tell)
    from tools.benchmarks import clock_cost

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
