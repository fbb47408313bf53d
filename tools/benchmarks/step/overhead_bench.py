"""Framework overhead on one rank: megatron_lsgd's training step vs a minimal plain-PyTorch
loop (same model, same batch, torch.optim.AdamW, loss.backward()), measured side by side
in one process, alternating rounds so machine noise hits both alike.

    python -m tools.bench step overhead  # small GPT on CPU
    python -m tools.bench step overhead --hidden-size 512 --num-layers 8 --seq-length 512

Prints a Markdown table and the ratio (ours / plain tokens per second).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

from tools.benchmarks.step.side_by_side import build, timed  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--steps", type=int, default=10, help="steps per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    p.add_argument("--clock", choices=["wall", "process"], default="wall",
                   help="process: CPU time of this process (steadier on a busy machine; CPU, one thread only)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    argv = ["--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size),
            "--num-attention-heads", str(a.num_attention_heads), "--seq-length", str(a.seq_length),
            "--micro-batch-size", str(a.micro_batch_size), "--train-iters", str(10 ** 6), "--lr", "1e-4",
            "--mock-data", "--vocab-size", str(a.vocab_size), "--eval-iters", "0",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--normalization", "RMSNorm",
            "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
            "--untie-embeddings-and-output-weights", "--clip-grad", "1.0"]
    run = build(argv)
    device, plain_step, ours_step = run.device, run.plain, run.ours
    clock = time.process_time if a.clock == "process" else time.perf_counter
    timed(plain_step, 2, device, clock)
    timed(ours_step, 2, device, clock)  # warm-up
    tokens = a.micro_batch_size * a.seq_length * a.steps
    plain_tps, ours_tps = [], []
    for _ in range(a.rounds):
        plain_tps.append(tokens / timed(plain_step, a.steps, device, clock))
        ours_tps.append(tokens / timed(ours_step, a.steps, device, clock))
    ratios = [o / q for o, q in zip(ours_tps, plain_tps)]
    n_params = sum(p.numel() for p in run.plain_model.parameters())
    print(f"model: {a.num_layers} layers, hidden {a.hidden_size}, seq {a.seq_length}, micro-batch "
          f"{a.micro_batch_size}, {n_params / 1e6:.1f}M parameters, device {device}, threads {torch.get_num_threads()}, clock {a.clock}")
    print("| loop | tokens/s (median of rounds) |\n|---|---|")
    print(f"| plain PyTorch | {statistics.median(plain_tps):.0f} |")
    print(f"| megatron_lsgd | {statistics.median(ours_tps):.0f} |")
    print(f"ratio megatron_lsgd / plain: median {statistics.median(ratios):.3f} "
          f"(rounds: {', '.join(f'{r:.3f}' for r in ratios)})")


if __name__ == "__main__":
    main()
