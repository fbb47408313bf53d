"""bf16 / fp16 paths (fp32 main params and optimizer state) run on CPU too."""

import pytest

from tests.unit_tests.harness import logged_losses, run_distributed

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "24", "--lr", "3e-3",
        "--mock-data", "--vocab-size", "256", "--log-interval", "4", "--eval-iters", "0",
        "--hidden-dropout", "0", "--attention-dropout", "0"]


@pytest.mark.slow
def test_bf16_tracks_fp32_and_fp16_recovers_from_overflow():
    fp32 = logged_losses(run_distributed(BASE, 1))
    bf16 = logged_losses(run_distributed(BASE + ["--bf16"], 1))
    # 2 ranks with ZeRO-1 exercises the separate fp32 main shards and the all-gather.
    fp16 = run_distributed(BASE + ["--fp16", "--initial-loss-scale", str(2.0 ** 20), "--hysteresis", "1",
                                   "--use-distributed-optimizer", "--global-batch-size", "8"], 2)
    assert fp32[-1] < fp32[0] - 0.2
    for a, b in zip(fp32, bf16):
        assert abs(a - b) / a < 0.03
    fp16_losses = logged_losses(fp16)
    assert fp16[-1]["skipped"] > 0  # 2^20 overflows fp16: steps skipped while the scale backs off
    assert fp16_losses[-1] < fp16_losses[0] - 0.2  # and then it trains
