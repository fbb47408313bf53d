"""The throughput and memory part of tools/gpu_check.sh's report: reads the JSON that
tools/benchmarks/step/mfu.py wrote into the check's output folder (mfu_eager, mfu_compiled,
mfu_mbs_eager, mfu_mbs_compiled, mfu_8b_full) and returns the report's lines, with issue 46's
targets for the compiled step said met or MISSED (MFU >= 0.45, >= 1.0x the compiled plain
loop, >= 1.15x the eager plain loop)."""

from __future__ import annotations

import json
import os
from typing import List, Optional

TARGET_MFU, TARGET_VS_COMPILED_PLAIN, TARGET_VS_EAGER_PLAIN = 0.45, 1.0, 1.15


def _fmt(v: Optional[float]) -> str:
    return f"{v:.3f}" if v is not None else "-"


def _mark(ok: bool) -> str:
    return "met" if ok else "MISSED"


def throughput_and_memory(out: str, mfu_rc: str, compiled_rc: str, memory: str) -> List[str]:
    """`*_rc`: the exit statuses of the eager and compiled mfu.py runs; `memory`: "0" when the
    memory probes were skipped."""

    def load(name):
        path = os.path.join(out, f"mfu_{name}.json")
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return json.load(f)

    fmt, mark = _fmt, _mark
    lines: List[str] = []
    eager, compiled = (load("eager") if mfu_rc == "0" else None), (load("compiled") if compiled_rc == "0" else None)
    if eager:
        m = eager
        size = f"{m['parameters'] / 1e9:.2f}B" if m['parameters'] >= 1e9 else f"{m['parameters'] / 1e6:.1f}M"
        lines += [f"- Throughput, {size}-parameter Llama ({m['preset']} preset), bf16, seq "
                  f"{m['seq_length']}, micro-batch {m['micro_batch_size']}, one GPU; compiled: each transformer "
                  "layer's forward compiled (`--compile`), in both loops alike:", "",
                  "| loop | layers | tokens/s | MFU | first step less a timed one (s) | peak CUDA MB (both loops) |",
                  "|---|---|---|---|---|---|"]
        for mode, run in (("eager", eager), ("compiled", compiled)):
            if run is None:
                lines.append(f"| (both) | {mode} | FAILED (see mfu_{mode}.log) | | | |")
                continue
            for label, key in (("plain PyTorch (autocast bf16, AdamW)", "plain"), ("megatron_lsgd", "ours")):
                lines.append(f"| {label} | {mode} | {run[key + '_tokens_per_s']:.0f} | {fmt(run[key + '_mfu'])} | "
                             f"{run[key + '_first_step_extra_s']:.1f} | {run.get('peak_cuda_allocated_mb', 0):.0f} |")
        lines += ["", f"  megatron_lsgd / plain, eager: {eager['ratio']:.3f}"]
        if compiled:
            vs_compiled = compiled["ours_tokens_per_s"] / compiled["plain_tokens_per_s"]
            vs_eager = compiled["ours_tokens_per_s"] / eager["plain_tokens_per_s"]
            mfu = compiled["ours_mfu"]
            lines += [f"  compiled megatron_lsgd / compiled plain: {vs_compiled:.3f} (target >= "
                      f"{TARGET_VS_COMPILED_PLAIN}: {mark(vs_compiled >= TARGET_VS_COMPILED_PLAIN)}); / eager plain: "
                      f"{vs_eager:.3f} (target >= {TARGET_VS_EAGER_PLAIN}: {mark(vs_eager >= TARGET_VS_EAGER_PLAIN)}); "
                      f"/ eager megatron_lsgd: {compiled['ours_tokens_per_s'] / eager['ours_tokens_per_s']:.3f}; "
                      f"MFU {fmt(mfu)} (target >= {TARGET_MFU}: {mark(mfu is not None and mfu >= TARGET_MFU)})",
                      f"  dynamo's counts over the compiled run (both loops): {compiled.get('compile_counts')}"]
    else:
        lines.append(f"- tools/benchmarks/step/mfu.py FAILED (exit {mfu_rc}); see mfu_eager.log")
    if memory != "0":
        lines += ["", "- Memory headroom (our loop alone, a fresh process per try):", ""]
        for mode in ("eager", "compiled"):
            r = load(f"mbs_{mode}")
            if r is None:
                lines.append(f"  - largest micro-batch, {mode}: FAILED (see mfu_mbs_{mode}.log)")
                continue
            tries = r["micro_batch_tries"]
            stop = next((f"; {k} did not fit: {v['error']}" for k, v in tries.items() if not v["fits"]), "")
            lines.append(f"  - largest micro-batch that steps ({r['preset']} preset, {mode}): "
                         f"{r['largest_micro_batch']} of {', '.join(tries)}{stop}")
        r = load("8b_full")
        if r is None:
            lines.append("  - 8B shape with --recompute-granularity full: FAILED (see mfu_8b_full.log)")
        elif r["fits"]:
            lines.append(f"  - 8B shape (Llama-3-8B, seq {r['seq_length']}, micro-batch {r['micro_batch_size']}) with "
                         f"--recompute-granularity full: starts and steps, {r['ours_tokens_per_s']:.0f} tokens/s, MFU "
                         f"{fmt(r['ours_mfu'])}, peak {r.get('peak_cuda_allocated_mb', 0):.0f} MB allocated")
        else:
            lines.append(f"  - 8B shape with --recompute-granularity full: does not fit: {r['error']}")
    return lines
