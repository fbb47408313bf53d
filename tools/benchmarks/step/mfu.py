"""Single-device throughput and model FLOPs utilisation (MFU): megatron_lsgd's training step
beside a plain-PyTorch loop of the same model (side_by_side.py), one rank, bf16.

    python -m tools.bench step mfu                  # ~1.1B Llama (TinyLlama's shape), bf16, one GPU
    python -m tools.bench step mfu --preset smoke   # a tiny Llama: proves the script runs (CPU too)
    python -m tools.bench step mfu --json out.json  # also write the figures (tools/gpu_check.sh)
    python -m tools.bench step mfu --compile        # both loops' layers compiled the same way (+ compile time)
    python -m tools.bench step mfu --largest-micro-batch 32 [--compile]   # memory headroom: 1, 2, 4, ... 32
    python -m tools.bench step mfu --preset 8b --recompute full --no-plain   # does the 8B shape start and step?

--compile compiles each transformer layer's forward (regional, core/transformer/compile.py) in
our step and in the plain loop alike, so the plain loop stays an honest peer; the first step
of each loop (the warm-up) then holds the compilation, reported as its time less a timed step's.
--largest-micro-batch tries each size in a fresh process (an out-of-memory error can leave a
process's allocator fragmented) with our loop alone, and reports the largest that stepped.
A step that runs out of device memory is reported (fits: false, the error's first line), not
raised: that is the answer the memory probes ask for.

MFU = model FLOPs per second / the device's peak dense bf16 FLOP/s. Model FLOPs are
compat_runtime.flops_per_sample (matrix products, forward + backward, no recomputation
counted). The peak comes from --peak-tflops, else from a small table of NVIDIA parts
(H100/H200 SXM 989, H100 PCIe 756, A100 312 TFLOP/s); on other devices MFU is not printed.
Timed steps synchronise the device; rounds alternate so drift hits both loops alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

from megatron_lsgd.training.compat_runtime import flops_per_sample  # noqa: E402
from megatron_lsgd.training.initialize import shutdown_distributed  # noqa: E402
from megatron_lsgd.training.logging_utils import peak_cuda_memory_mb  # noqa: E402
from megatron_lsgd.core.output_files import write_json  # noqa: E402
from tools.benchmarks.step.side_by_side import build, timed  # noqa: E402
from tools.benchmarks.tool_input import tool_errors  # noqa: E402

LLAMA = ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--group-query-attention", "--hidden-dropout", "0",
         "--attention-dropout", "0"]
PRESETS: Dict[str, Dict[str, object]] = {
    # TinyLlama-1.1B's shape: 22 layers, hidden 2048, 32 heads in 4 KV groups, SwiGLU 5632, vocab 32000
    "1b": dict(layers=22, hidden=2048, heads=32, groups=4, ffn=5632, vocab=32000, seq=2048, mbs=4, bf16=True,
               steps=10, rounds=3),
    # GPT-2 small's size in Llama's shape (clock_cost.py): launch-bound enough to show host waits
    "125m": dict(layers=12, hidden=768, heads=12, groups=4, ffn=2048, vocab=32000, seq=1024, mbs=4, bf16=True,
                 steps=20, rounds=3),
    # Llama-3-8B's shape: 32 layers, hidden 4096, 32 heads in 8 KV groups, SwiGLU 14336, vocab 128256
    "8b": dict(layers=32, hidden=4096, heads=32, groups=8, ffn=14336, vocab=128256, seq=8192, mbs=1, bf16=True,
               steps=2, rounds=1),
    "smoke": dict(layers=2, hidden=64, heads=4, groups=2, ffn=128, vocab=256, seq=64, mbs=2, bf16=True,
                  steps=2, rounds=1),
}
PEAK_BF16_TFLOPS = [("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("A100", 312.0)]


def peak_tflops(device: torch.device, override: Optional[float]) -> Optional[float]:
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops for part, tflops in PEAK_BF16_TFLOPS if part in name), None)


def argv_for(p: Dict[str, object], recompute: List[str], compile_layers: bool = False) -> List[str]:
    return ["--num-layers", str(p["layers"]), "--hidden-size", str(p["hidden"]), "--num-attention-heads",
            str(p["heads"]), "--num-query-groups", str(p["groups"]), "--ffn-hidden-size", str(p["ffn"]),
            "--seq-length", str(p["seq"]), "--micro-batch-size", str(p["mbs"]), "--vocab-size", str(p["vocab"]),
            "--make-vocab-size-divisible-by", "128", "--train-iters", str(10 ** 6), "--lr", "1e-4",
            "--mock-data", "--eval-iters", "0", "--clip-grad", "1.0", "--log-interval", str(10 ** 6)] + \
        (["--bf16"] if p["bf16"] else []) + LLAMA + recompute + (["--compile"] if compile_layers else [])


def profile(step, device: torch.device, top: int) -> Dict[str, float]:
    """Where a step's time goes: prints the top operators by self device time and returns the
    shares of the profiled wall time spent in matrix products, attention and the optimizer step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        wall_us = timed(step, 3, device) * 1e6
    events = prof.key_averages()
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"

    def share(match, field: str = key) -> float:  # operators only (aten::...), not their kernels again
        return sum(getattr(e, field) for e in events if match(e.key)) / wall_us

    print(events.table(sort_by=key, row_limit=top))
    shares = {"matmul": share(lambda k: k in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")),
              "attention": share(lambda k: k.startswith("aten::") and "attention" in k),
              # a range: on a GPU its own device time is its kernels'; on a CPU its children hold the work
              "optimizer": share(lambda k: k.startswith("Optimizer.step"),
                                 key if device.type == "cuda" else "cpu_time_total")}
    print("share of the step's wall time: " + ", ".join(f"{k} {v:.2f}" for k, v in shares.items()))
    return shares


def largest_micro_batch(base_argv: List[str], limit: int) -> Dict[str, object]:
    """Micro-batches 1, 2, 4, ... up to `limit`, each in a fresh process with our loop alone
    (one step); the largest that stepped, and each try's outcome."""
    tries, largest, size = {}, 0, 1
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    with tempfile.TemporaryDirectory() as tmp:
        while size <= limit:
            out = os.path.join(tmp, f"mbs{size}.json")
            cmd = [sys.executable, os.path.abspath(__file__)] + base_argv + [
                "--micro-batch-size", str(size), "--steps", "1", "--rounds", "1", "--no-plain", "--json", out]
            proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if proc.returncode == 0 and os.path.exists(out):
                with open(out) as f:
                    probe = json.load(f)
                tries[size] = {"fits": probe["fits"], "error": probe.get("error"),
                               "peak_cuda_allocated_mb": probe.get("peak_cuda_allocated_mb")}
            else:
                tail = proc.stdout.strip().splitlines()[-1:] or ["no output"]
                tries[size] = {"fits": False, "error": f"exit {proc.returncode}: {tail[0][:200]}"}
            if not tries[size]["fits"]:
                break
            largest, size = size, size * 2
    return {"largest_micro_batch": largest, "micro_batch_tries": tries}


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]


def main(argv: Optional[List[str]] = None) -> Dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    ap.add_argument("--steps", type=int, default=None, help="steps per round (default: the preset's)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default: the preset's)")
    ap.add_argument("--micro-batch-size", type=int, default=None, help="default: the preset's")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the device's peak dense bf16 TFLOP/s")
    ap.add_argument("--recompute", choices=["none", "selective", "full"], default="none",
                    help="full: --recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    ap.add_argument("--compile", action="store_true",
                    help="compile each transformer layer's forward, in our step and in the plain loop alike")
    ap.add_argument("--no-plain", action="store_true", help="our loop alone (memory probes, large shapes)")
    ap.add_argument("--largest-micro-batch", type=int, default=0, metavar="N",
                    help="instead of timing: the largest micro-batch of 1, 2, 4, ... N that steps (our loop, "
                         "a fresh process per size)")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--profile", type=int, default=0, metavar="K",
                    help="after timing, profile 3 of our steps and print the K operators with the most device "
                         "time (torch.profiler), and the step's shares in matrix products, attention and the optimizer")
    a = ap.parse_args(argv)
    preset = dict(PRESETS[a.preset])
    preset.update({k: v for k, v in (("steps", a.steps), ("rounds", a.rounds), ("mbs", a.micro_batch_size))
                   if v is not None})
    if a.steps is not None and a.steps < 1 or a.rounds is not None and a.rounds < 1:
        ap.error("--steps and --rounds must be >= 1")
    if a.micro_batch_size is not None and a.micro_batch_size < 1:
        ap.error("--micro-batch-size must be >= 1")
    if a.profile < 0:
        ap.error("--profile must be >= 0")
    if a.largest_micro_batch < 0:
        ap.error("--largest-micro-batch must be >= 1")
    if a.largest_micro_batch and a.micro_batch_size is not None:
        ap.error("--largest-micro-batch chooses the micro-batch itself: drop --micro-batch-size")
    recompute = {"none": [], "selective": ["--recompute-granularity", "selective"],
                 "full": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                          "--recompute-num-layers", "1"]}[a.recompute]

    if a.largest_micro_batch:
        base = ["--preset", a.preset, "--recompute", a.recompute] + (["--compile"] if a.compile else [])
        result = {"preset": a.preset, "recompute": a.recompute, "compile": a.compile,
                  **largest_micro_batch(base, a.largest_micro_batch)}
        print(f"largest micro-batch that steps ({a.preset}, {'compiled' if a.compile else 'eager'}, recompute "
              f"{a.recompute}): {result['largest_micro_batch']}")
        for size, outcome in result["micro_batch_tries"].items():
            print(f"  micro-batch {size}: " + ("fits" if outcome["fits"] else f"does not fit ({outcome['error']})"))
        _write(a.json, result)
        return result

    try:
        result = measure(a, preset, recompute)
    except torch.OutOfMemoryError as err:  # the memory probes' answer, not a failure of the tool
        result = {"preset": a.preset, "recompute": a.recompute, "compile": a.compile, "micro_batch_size": preset["mbs"],
                  "fits": False, "error": _first_line(err)}
        print(f"does not fit: {result['error']}")
    _write(a.json, result)
    return result


def _write(path: Optional[str], result: Dict[str, object]) -> None:
    if path:
        write_json(path, result, indent=1)


def measure(a, preset: Dict[str, object], recompute: List[str]) -> Dict[str, object]:
    run = build(argv_for(preset, recompute, a.compile), with_plain=not a.no_plain)
    device = run.device
    model_cfg = run.trainer.config.model
    flops_per_token = flops_per_sample(model_cfg, model_cfg.padded_vocab_size) / model_cfg.seq_length
    loops = {"ours": run.ours} if a.no_plain else {"plain": run.plain, "ours": run.ours}
    # warm-up: the first step holds compilation (with --compile), the second the allocator's and kernels' settling
    first = {name: timed(step, 1, device) for name, step in loops.items()}
    for step in loops.values():
        timed(step, 1, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    tokens = run.tokens_per_step * preset["steps"]
    rates: Dict[str, List[float]] = {name: [] for name in loops}
    for _ in range(preset["rounds"]):
        for name, step in loops.items():
            rates[name].append(tokens / timed(step, preset["steps"], device))
    peak = peak_tflops(device, a.peak_tflops)
    n_params = sum(p.numel() for p in run.trainer.model.module.parameters()) if a.no_plain else \
        sum(p.numel() for p in run.plain_model.parameters())
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
              "preset": a.preset, "recompute": a.recompute, "compile": a.compile, "parameters": n_params,
              "seq_length": model_cfg.seq_length, "micro_batch_size": preset["mbs"], "fits": True,
              "peak_tflops": peak, **peak_cuda_memory_mb(device)}
    for name in loops:
        result[f"{name}_tokens_per_s"] = statistics.median(rates[name])
        result[f"{name}_mfu"] = result[f"{name}_tokens_per_s"] * flops_per_token / (peak * 1e12) if peak else None
        # the first step less a timed one: compilation (and first-touch costs, also there eagerly)
        result[f"{name}_first_step_extra_s"] = first[name] - run.tokens_per_step / result[f"{name}_tokens_per_s"]
    if not a.no_plain:
        result["ratio"] = statistics.median(o / q for o, q in zip(rates["ours"], rates["plain"]))
    if run.trainer.compile_report is not None:
        from megatron_lsgd.core.transformer.compile import CompileCounts

        result["compile_counts"] = dataclasses.asdict(CompileCounts.now() - run.trainer.compile_report.start)

    print(f"model: {preset['layers']} layers, hidden {preset['hidden']}, seq {model_cfg.seq_length}, micro-batch "
          f"{preset['mbs']}, {n_params / 1e9:.2f}B parameters, {'bf16' if preset['bf16'] else 'fp32'}, "
          f"recompute {a.recompute}, {'compiled layers' if a.compile else 'eager'}, device {result['device']}")
    print("| loop | tokens/s (median of rounds) | MFU | first step less a timed one (s) |\n|---|---|---|---|")
    for label, name in (("plain PyTorch", "plain"), ("megatron_lsgd", "ours")):
        if name not in loops:
            continue
        mfu = f"{result[name + '_mfu']:.3f}" if result[name + "_mfu"] is not None else "- (peak unknown)"
        print(f"| {label} | {result[name + '_tokens_per_s']:.0f} | {mfu} | "
              f"{result[name + '_first_step_extra_s']:.1f} |")
    if "ratio" in result:
        print(f"ratio megatron_lsgd / plain: {result['ratio']:.3f}")
    if "compile_counts" in result:
        print(f"compile counts (whole process): {result['compile_counts']}")
    if "peak_cuda_allocated_mb" in result:
        print(f"peak CUDA memory (MB, {'our loop' if a.no_plain else 'both loops'}): "
              f"{result['peak_cuda_allocated_mb']:.0f} allocated, {result['peak_cuda_reserved_mb']:.0f} reserved")
    if a.profile:
        result["profile"] = profile(run.ours, device, a.profile)
    return result


if __name__ == "__main__":
    with tool_errors():
        main()
    shutdown_distributed()  # torch warns at exit about a process group left up
