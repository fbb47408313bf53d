"""Validate the simulated clock against the real emulated WAN (issue 21, item 5).

    python tools/benchmarks/validate_clock.py                      # every algorithm, 2 repetitions
    python tools/benchmarks/validate_clock.py --algorithms sync,diloco --repeats 3 --train-iters 40

Runs `wan_bench.py` (tools/wan namespaces: 2 sites, 100 Mbit/s, 20 ms one way, its 7.2M
Llama) --repeats times on the real clock, then once more with every run on the simulated
clock (`--simulate-clock` with the same link), and compares each algorithm's time per step
and its ratio to the ceiling (updates/s against every site training alone).

The simulated compute costs are calibrated from the real runs, so that what is validated is
the simulator's model of communication and overlap, not this CPU's speed: one step of the
ceiling (median over repetitions) is two micro-batches plus one optimizer step, and the
optimizer step is taken as 11.4 ns per parameter (a bare AdamW step over the leaderboard
model on this machine: 0.017 s for 1.49M parameters, tools/benchmarks/scenarios/
emulated-default.toml). The simulated runs are deterministic, so one suffices.

Run it on a quiet machine (real time is measured): other jobs beside it move the real
figures. Writes docs/leaderboard/validation.md (which leaderboard.py includes in
docs/leaderboard.md) and the wan_bench outputs under --out-dir.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from megatron_lsgd.core.lsgd.catalog import registered_algorithms  # noqa: E402
from tools.benchmarks import wan_bench, wan_report  # noqa: E402

PARAMS = 7_211_264  # wan_bench's model (docs/benchmarks.md; its log prints the count)
OPTIMIZER_S_PER_PARAM = 0.017 / 1_491_584
TOLERANCE = 0.10


def bench(out_dir: str, args, extra: str = "") -> Dict[str, dict]:
    """One wan_bench invocation; its results by algorithm (the ceiling included)."""
    argv = ["--algorithms", args.algorithms, "--train-iters", str(args.train_iters), "--log-interval",
            str(args.log_interval), "--rate-mbit", str(args.rate_mbit), "--delay-ms", str(args.delay_ms),
            "--out-dir", out_dir]
    if extra:
        argv += ["--extra-args", extra]
    if wan_bench.main(argv) != 0:
        raise SystemExit(f"error: wan_bench failed; see {out_dir}/logs")
    with open(os.path.join(out_dir, "results.json")) as f:
        return {r["algorithm"]: r for r in json.load(f)["runs"]}


def step_seconds(run: dict) -> float:
    return 1.0 / run["updates_per_s"]


def compare(real: List[Dict[str, dict]], sim: Dict[str, dict]) -> List[dict]:
    """Per algorithm: real time per step (median, min, max over repetitions) and ratio to the
    ceiling (each repetition against its own ceiling), the prediction, and the errors."""
    rows = []
    for name in sim:
        if name == wan_report.CEILING or not all(name in r for r in real):
            continue  # the ceiling calibrated the compute: it would agree by construction
        seconds = [step_seconds(r[name]) for r in real]
        ratios = [r[name]["updates_per_s"] / r[wan_report.CEILING]["updates_per_s"] for r in real]
        predicted = step_seconds(sim[name])
        predicted_ratio = sim[name]["updates_per_s"] / sim[wan_report.CEILING]["updates_per_s"]
        real_s, real_ratio = statistics.median(seconds), statistics.median(ratios)
        rows.append({"algorithm": name, "real_s": real_s, "real_s_range": [min(seconds), max(seconds)],
                     "predicted_s": predicted, "error": predicted / real_s - 1.0,
                     "real_ratio": real_ratio, "predicted_ratio": predicted_ratio,
                     "ratio_error": predicted_ratio / real_ratio - 1.0})
    return rows


def table(rows: List[dict], header: List[str]) -> str:
    lines = header + ["", "| algorithm | real s/step (median [min, max]) | simulated s/step | error | "
                      "real updates vs ceiling | simulated | error | within 10% |",
                      "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = abs(r["error"]) <= TOLERANCE and abs(r["ratio_error"]) <= TOLERANCE
        lines.append(f"| {r['algorithm']} | {r['real_s']:.3f} [{r['real_s_range'][0]:.3f}, {r['real_s_range'][1]:.3f}]"
                     f" | {r['predicted_s']:.3f} | {100 * r['error']:+.0f}% | {r['real_ratio']:.3f} | "
                     f"{r['predicted_ratio']:.3f} | {100 * r['ratio_error']:+.0f}% | {'yes' if ok else '**no**'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algorithms", default=",".join(registered_algorithms()))
    p.add_argument("--repeats", type=int, default=2, help="real wan_bench invocations (interleaving is by run: "
                   "each invocation runs the ceiling and every algorithm in turn)")
    p.add_argument("--train-iters", type=int, default=20)
    p.add_argument("--log-interval", type=int, default=4)
    p.add_argument("--rate-mbit", type=float, default=100.0)
    p.add_argument("--delay-ms", type=float, default=20.0)
    p.add_argument("--out-dir", default=os.path.join(ROOT, "runs", "validate_clock",
                                                     datetime.datetime.now().strftime("%Y%m%d-%H%M%S")))
    p.add_argument("--doc", default=os.path.join(ROOT, "docs", "leaderboard", "validation.md"))
    args = p.parse_args(argv)
    if args.repeats < 1 or args.train_iters < 2 * args.log_interval:
        p.error("--repeats must be >= 1 and --train-iters at least two log intervals")
    real = [bench(os.path.join(args.out_dir, f"real{i}"), args) for i in range(args.repeats)]
    step = statistics.median(step_seconds(r[wan_report.CEILING]) for r in real)
    optimizer = OPTIMIZER_S_PER_PARAM * PARAMS
    microbatch = (step - optimizer) / 2  # wan_bench: two micro-batches of 4 per site step
    if microbatch <= 0:
        raise SystemExit(f"error: the ceiling's step ({step:.3f} s) is shorter than the assumed optimizer step")
    extra = (f"--simulate-clock --simulate-microbatch-seconds {microbatch:.5f} --simulate-optimizer-step-seconds "
             f"{optimizer:.5f} --simulate-inter-site-bandwidth {args.rate_mbit:g} "
             f"--simulate-inter-site-latency {args.delay_ms:g}")
    sim = bench(os.path.join(args.out_dir, "simulated"), args, extra)
    rows = compare(real, sim)
    header = [f"{datetime.date.today().isoformat()}, `python tools/benchmarks/validate_clock.py "
              f"--algorithms {args.algorithms} --repeats {args.repeats} --train-iters {args.train_iters}` on "
              f"{os.cpu_count()} CPUs: wan_bench's 7.2M Llama, 2 sites x 1 rank, {args.rate_mbit:g} Mbit/s, "
              f"{args.delay_ms:g} ms one way; {args.repeats} real invocation(s) against one simulated "
              f"(compute calibrated from the real ceiling: micro-batch {microbatch:.4f} s, optimizer step "
              f"{optimizer:.4f} s). Time per step excludes the first log interval. The bar: within 10% in "
              "both columns."]
    text = table(rows, header)
    os.makedirs(os.path.dirname(args.doc), exist_ok=True)
    with open(args.doc, "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out_dir, "validation.json"), "w") as f:
        json.dump({"rows": rows, "microbatch_s": microbatch, "optimizer_s": optimizer}, f, indent=1)
    print(text)
    print(f"wrote {args.doc}; `python tools/benchmarks/leaderboard.py --cached-only` puts it in docs/leaderboard.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
