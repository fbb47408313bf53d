"""What the device-synchronised clock costs a training step (core/clock.py), one rank.

On a GPU `Clock.now()` first waits for the thread's stream, so a reading stops the host from
queueing kernels ahead of the device. This times our step (side_by_side.py, the loop's step)
three ways, rounds alternating so drift hits each alike:

- `none`: no reading inside the timed steps (the ceiling),
- `per step`: one reading after each step (the loop's timers; every run pays this),
- `per layer`: one more after every transformer layer's forward (the worst case: the emulated
  link `--simulate-inter-site-*` and a-edit read once per collective or decision, never this often).

    python -m tools.bench step clock                 # a ~125M Llama, bf16 (one GPU)
    python -m tools.bench step clock --preset smoke  # proves the script runs (CPU too)

On the host the wait is a no-op, so there the ratios are 1 within noise.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Callable, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

from megatron_lsgd.core.clock import Clock  # noqa: E402
from megatron_lsgd.core.transformer.layer import TransformerLayer  # noqa: E402
from megatron_lsgd.training.initialize import shutdown_distributed  # noqa: E402
from tools.benchmarks.step.mfu import PRESETS, argv_for  # noqa: E402
from tools.benchmarks.step.side_by_side import build, timed  # noqa: E402

MODES = ("none", "per step", "per layer")


def main(argv: Optional[List[str]] = None) -> Dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="125m")
    ap.add_argument("--steps", type=int, default=50, help="steps per round and mode")
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args(argv)
    if a.steps < 1 or a.rounds < 1:
        ap.error("--steps and --rounds must be >= 1")
    run = build(argv_for(PRESETS[a.preset], []))
    clock = Clock().for_device(run.device)
    layers = [m for m in run.trainer.model.modules() if isinstance(m, TransformerLayer)]
    read_per_layer = [False]

    def after_layer(*_):
        if read_per_layer[0]:
            clock.now()

    for layer in layers:
        layer.register_forward_hook(after_layer)

    def step_for(mode: str) -> Callable[[], None]:
        def step():
            read_per_layer[0] = mode == "per layer"
            run.ours()
            if mode != "none":
                clock.now()
        return step

    for mode in MODES:
        timed(step_for(mode), 2, run.device)  # warm-up
    seconds: Dict[str, List[float]] = {m: [] for m in MODES}
    for _ in range(a.rounds):
        for mode in MODES:
            seconds[mode].append(timed(step_for(mode), a.steps, run.device) / a.steps)
    read_per_layer[0] = False
    result = {mode: statistics.median(s) for mode, s in seconds.items()}
    device = torch.cuda.get_device_name(run.device) if run.device.type == "cuda" else str(run.device)
    print(f"preset {a.preset}, {len(layers)} layers, device {device}, {a.rounds} rounds x {a.steps} steps per mode")
    print("| readings | ms per step (median of rounds) | / none |\n|---|---|---|")
    for mode in MODES:
        print(f"| {mode} | {result[mode] * 1e3:.2f} | {result[mode] / result['none']:.3f} |")
    return result


if __name__ == "__main__":
    main()
    shutdown_distributed()  # torch warns at exit about a process group left up
