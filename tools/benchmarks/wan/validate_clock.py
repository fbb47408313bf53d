"""Validate the simulated clock against the real emulated WAN (issue 21, item 5).

    python -m tools.bench validate                                     # every algorithm, 2 repetitions
    python -m tools.bench validate --algorithms sync,diloco --repeats 3 --train-iters 40
    python -m tools.bench validate --probe-only --probe-bytes 5966336  # a scenario's [link] keys
    python -m tools.bench validate --slow-factor 2                     # site 1 two times slower
    python -m tools.bench validate --rate-mbit 30 --delay-ms 60        # a second link

Runs `wan_bench.py` (tools/wan namespaces: 2 sites, 100 Mbit/s, 20 ms one way by default,
`--rate-mbit`/`--delay-ms` for another link, its 7.2M Llama; `--slow-factor F`: rank 1, site
1, a straggler F x slower in every run, real and simulated) --repeats times on the real clock, then once more with every run on the simulated
clock (`--simulate-clock` with the same link), and compares each algorithm's time per step
and its ratio to the ceiling (updates/s against every site training alone).

The simulated compute costs are calibrated from the real runs, so that what is validated is
the simulator's model of communication and overlap, not this CPU's speed: one step of the
ceiling (median over repetitions; with a straggler, of the fast site 0 training alone) is
two micro-batches plus one optimizer step, and the
optimizer step is taken as 11.4 ns per parameter (a bare AdamW step over the leaderboard
model on this machine: 0.017 s for 1.49M parameters, tools/benchmarks/scenarios/
emulated-default.toml). The simulated link's rate is what TCP delivers over the emulated
link for a blocking exchange, measured just before the simulated run by a collective probe
(tools/wan/collective_probe.py: a gloo all-reduce of `--probe-bytes` after an idle gap, as
between two training steps), its latency per phase by a second probe of 4 kB (whose time is
all latency: a two-site all-reduce is 2 phases, `delays_per_phase` = its time / (2 x the
one-way delay)), and the CPU that exchange keeps busy per MB is charged to the
sending rank's compute (on 2 cores the emulated link, the kernel's TCP and gloo's threads
run on the ranks' cores). `--simulated-rate goodput` charges what a bulk TCP probe
delivers and no CPU, `line` the line rate and no CPU: they show how much each part
matters. The probe's CPU figure needs a quiet machine as much as the real runs do
(`--link` reuses a quiet probe's figures). The simulated runs are deterministic, so one
suffices; `--real-from DIR` reuses an earlier validation's real runs.

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
import subprocess
import sys
from typing import Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)

from megatron_lsgd.core.lsgd.catalog import registered_algorithms  # noqa: E402
from megatron_lsgd.core.lsgd.comm import InterSiteComm  # noqa: E402
from megatron_lsgd.core.simulation import CLOCK_MODEL  # noqa: E402
from megatron_lsgd.core.output_files import write_json, write_text  # noqa: E402
from tools.benchmarks.wan import wan_bench, wan_report  # noqa: E402
from tools.benchmarks.run_cache import results_path  # noqa: E402
from tools.benchmarks.tool_input import tool_errors  # noqa: E402
from tools.wan.launch import site_env  # noqa: E402
from tools.wan.link import LinkSpec  # noqa: E402
from tools.wan.topology import REPO_ROOT, WanTopology  # noqa: E402

PARAMS = 7_211_264  # wan_bench's model (docs/benchmarks.md; its log prints the count)
OPTIMIZER_S_PER_PARAM = 0.017 / 1_491_584
TOLERANCE = 0.10
PHASES = InterSiteComm(None, 2).phases("all_reduce")  # of the probes' two-site all-reduce
LATENCY_PROBE_BYTES = 4096  # a probe whose time is its latency (1 ms of 240 at 30 Mbit/s, 60 ms)
SLOW_RANK = 1  # --slow-factor slows site 1 (one rank per site)


def bench(out_dir: str, args, extra: str = "") -> Dict[str, dict]:
    """One wan_bench invocation; its results by algorithm (the ceiling included)."""
    argv = ["--algorithms", args.algorithms, "--train-iters", str(args.train_iters), "--log-interval",
            str(args.log_interval), "--rate-mbit", str(args.rate_mbit), "--delay-ms", str(args.delay_ms),
            "--out-dir", out_dir]
    if extra:
        argv += ["--extra-args", extra]
    if args.slow_factor > 1:
        argv += ["--slow-ranks", str(SLOW_RANK), "--slow-factor", str(args.slow_factor)]
    for item in args.algo_args:
        argv += ["--algo-args", item]
    if wan_bench.main(argv) != 0:
        raise SystemExit(f"error: wan_bench failed; see {os.path.join(results_path(out_dir), 'logs')}")
    with open(os.path.join(results_path(out_dir), "results.json")) as f:  # (wan_bench's data: never in docs/)
        return {r["algorithm"]: r for r in json.load(f)["runs"]}


def probe_goodput(rate_mbit: float, delay_ms: float, nbytes: int, repeats: int) -> float:
    """What TCP delivers over the emulated link (Mbit/s, median of `repeats`): `nbytes` sent
    from each site to the other at once, as a two-site ring all-reduce moves them, timed from
    the first byte to the receiver's acknowledgement, less the two one-way delays of that
    acknowledgement's round. The simulated link charges bytes at this rate."""
    py = [sys.executable, "-m", "tools.wan.measure"]
    rates = []
    with WanTopology(2, LinkSpec(rate_mbit, delay_ms)) as wan:
        for _ in range(repeats):
            servers = [subprocess.Popen(wan.in_site(i, py + ["serve", "--timeout", "120"]), cwd=REPO_ROOT,
                                        stdout=subprocess.PIPE, text=True) for i in (0, 1)]
            try:
                for server in servers:
                    if server.stdout.readline().strip() != "listening":
                        raise SystemExit("error: the goodput probe's server did not start")
                clients = [subprocess.Popen(wan.in_site(i, py + ["bulk", "--host", wan.site_ip(1 - i), "--bytes",
                                                                 str(nbytes), "--timeout", "120"]),
                                            cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True) for i in (0, 1)]
                for client in clients:
                    out, _ = client.communicate(timeout=180)
                    if client.returncode != 0:
                        raise SystemExit("error: the goodput probe's transfer failed")
                    seconds = json.loads(out)["seconds"] - 2 * delay_ms / 1e3
                    rates.append(8 * nbytes / seconds / 1e6)
            finally:
                for server in servers:
                    if server.poll() is None:
                        server.kill()
                    server.wait()
                    server.stdout.close()
    return statistics.median(rates)


def probe_collective(rate_mbit: float, delay_ms: float, nbytes: int, repeats: int) -> Dict[str, List[float]]:
    """A blocking two-site exchange over the emulated link (tools/wan/collective_probe.py: a
    gloo all-reduce of `nbytes` after an idle gap, `repeats` times): every repetition's
    seconds and the machine's busy CPU seconds, printed and returned (`seconds`, `busy_cpu_s`)."""
    cmd = [sys.executable, "-m", "tools.wan.collective_probe", "--bytes", str(nbytes), "--repeats", str(repeats)]
    with WanTopology(2, LinkSpec(rate_mbit, delay_ms)) as wan:
        procs = [subprocess.Popen(wan.in_site(i, cmd + ["--rank", str(i), "--master", wan.site_ip(0)]), cwd=REPO_ROOT,
                                  env=site_env(), stdout=subprocess.PIPE, text=True) for i in (0, 1)]
        outs = [proc.communicate(timeout=600)[0] for proc in procs]
    if any(proc.returncode != 0 for proc in procs):
        raise SystemExit("error: the collective probe failed (tools/wan/collective_probe.py; see its output above)")
    result = json.loads(outs[0].strip().splitlines()[-1])
    print(f"collective probe, {nbytes} bytes over {rate_mbit:g} Mbit/s, {delay_ms:g} ms: seconds "
          f"{', '.join(f'{s:.4f}' for s in result['seconds'])}; busy CPU s "
          f"{', '.join(f'{c:.4f}' for c in result['busy_cpu_s'])}", flush=True)
    return result


def calibrate_link(rate_mbit: float, delay_ms: float, nbytes: int, repeats: int) -> Tuple[float, float, float]:
    """(rate, CPU s per MB, delays per phase) of the link model, from a probe of `nbytes` and
    one of LATENCY_PROBE_BYTES over the emulated link."""
    latency = probe_collective(rate_mbit, delay_ms, LATENCY_PROBE_BYTES, repeats)
    delays = delays_per_phase(latency["seconds"], delay_ms)
    bulk = probe_collective(rate_mbit, delay_ms, nbytes, repeats)
    rate, cpu = link_keys(nbytes, bulk["seconds"], bulk["busy_cpu_s"], delay_ms, delays)
    return rate, cpu, delays


def delays_per_phase(seconds: List[float], delay_ms: float) -> float:
    """One-way delays per phase of a two-site all-reduce whose time is all latency (the
    median of `seconds` over its PHASES phases of `delay_ms`)."""
    if delay_ms <= 0:
        return 1.0  # no delay to count in: the model's default
    return statistics.median(seconds) / (PHASES * delay_ms / 1e3)


def link_keys(nbytes: int, seconds: List[float], busy_cpu_s: List[float], delay_ms: float,
              delays: float = 1.0) -> Tuple[float, float]:
    """(rate in Mbit/s, CPU seconds per MB sent) from a two-site all-reduce of `nbytes` each
    site sends: the rate at which the link model's latency (PHASES x `delays` one-way
    delays) + bytes / rate takes the median time, and the median busy CPU over the bytes
    both sites sent."""
    moving = statistics.median(seconds) - PHASES * delays * delay_ms / 1e3
    if moving <= 0:
        raise SystemExit(f"error: the collective probe took {statistics.median(seconds):.3f} s, no more than the "
                         f"link model's latency ({PHASES} phases x {delays:.2f} x {delay_ms:g} ms): nothing was "
                         f"measured")
    return 8 * nbytes / moving / 1e6, statistics.median(busy_cpu_s) / (2 * nbytes / 1e6)


def step_seconds(run: dict) -> float:
    return 1.0 / run["updates_per_s"]


def calibration_step(real: List[Dict[str, dict]], real_dirs: List[str], slow: bool) -> float:
    """Seconds of one unslowed step, the median over the real repetitions: the ceiling's
    (every site alone, the mean of their rates), or with a straggler its fast site 0's alone,
    read from that repetition's log (the ceiling's mean then includes the slow site)."""
    if not slow:
        return statistics.median(step_seconds(r[wan_report.CEILING]) for r in real)
    return statistics.median(step_seconds(wan_report.summarize(wan_report.read_log(
        os.path.join(results_path(d), "logs", f"{wan_report.CEILING}.site0.jsonl")))) for d in real_dirs)


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
    p.add_argument("--slow-factor", type=float, default=1.0,
                   help="the straggler scenario: rank 1 (site 1) computes this many times slower in every run, real "
                        "and simulated (--simulate-slow-ranks 1; 1: none)")
    p.add_argument("--out-dir", default=os.path.join(ROOT, "runs", "validate_clock",
                                                     datetime.datetime.now().strftime("%Y%m%d-%H%M%S")))
    p.add_argument("--algo-args", action="append", default=[], metavar="ALGO=FLAGS",
                   help="flags for one algorithm's runs, real and simulated (wan_bench's --algo-args; repeatable), "
                        "e.g. 'diloco=--lsgd-interval 5' so that a 20-step run holds rounds")
    p.add_argument("--doc", default=os.path.join(ROOT, "docs", "leaderboard", "validation.md"))
    p.add_argument("--append", action="store_true", help="add this table to --doc instead of replacing it")
    p.add_argument("--simulated-rate", choices=["collective", "goodput", "line"], default="collective",
                   help="the simulated link: what a blocking all-reduce achieves over the emulated link and the CPU "
                        "it takes per MB, measured by a collective probe before the simulated run (collective); what "
                        "TCP delivers to a bulk probe, no CPU charged (goodput); or the configured --rate-mbit (line)")
    p.add_argument("--probe-bytes", type=int, default=4 * PARAMS,
                   help="bytes each site sends in the probe (default: one fp32 gradient of wan_bench's model, "
                        "what sync's ring moves per rank and step)")
    p.add_argument("--probe-only", action="store_true",
                   help="run the collective probe alone (--probe-bytes: the gradient size of the scenario's trained "
                        "model) and print the [link] keys of a scenario calibrated from it")
    p.add_argument("--link", metavar="MBIT,S_PER_MB,DELAYS_PER_PHASE",
                   help="with --simulated-rate collective: use this rate, CPU per MB and delays per phase (an earlier "
                        "probe's, as --probe-only prints them) instead of probing now; for a machine that is not quiet")
    p.add_argument("--real-from", metavar="DIR",
                   help="reuse the real runs of an earlier validation (its real<i>/results.json) instead of running them")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.train_iters < 2 * args.log_interval:
        p.error("--repeats must be >= 1 and --train-iters at least two log intervals")
    if not args.slow_factor >= 1:
        p.error(f"--slow-factor {args.slow_factor:g}: must be >= 1 (1: no straggler)")
    if args.link and args.simulated_rate != "collective":  # checked before any run starts
        p.error("--link gives what the collective probe would measure: it needs --simulated-rate collective")
    given_link = None
    if args.link:
        try:
            given_link = tuple(float(x) for x in args.link.split(","))
        except ValueError:
            given_link = ()
        if len(given_link) != 3:
            p.error(f"--link {args.link!r}: give MBIT,S_PER_MB,DELAYS_PER_PHASE, e.g. 76.0,0.00468,2.0")
    if args.probe_only:
        rate, cpu_per_mb, delays = calibrate_link(args.rate_mbit, args.delay_ms, args.probe_bytes, repeats=3)
        print(f"# {datetime.date.today().isoformat()}: gloo all-reduces of {args.probe_bytes / 1e6:.2f} MB and "
              f"{LATENCY_PROBE_BYTES} bytes over the emulated {args.rate_mbit:g} Mbit/s, {args.delay_ms:g} ms link "
              f"(tools/wan/collective_probe.py, median of 3; --link {rate:.1f},{cpu_per_mb:.5f},{delays:.2f})\n"
              f"rate_mbit = {rate:.1f}\nlatency_ms = {args.delay_ms:g}\ndelays_per_phase = {delays:.2f}\n"
              f"cpu_seconds_per_mb = {cpu_per_mb:.5f}")
        return 0
    real_dirs = [os.path.join(args.real_from or args.out_dir, f"real{i}") for i in range(args.repeats)]
    if args.real_from:
        real = []
        for d in real_dirs:
            with open(os.path.join(results_path(d), "results.json")) as f:
                real.append({r["algorithm"]: r for r in json.load(f)["runs"]})
    else:
        real = [bench(d, args) for d in real_dirs]
    rate, cpu_per_mb, delays = args.rate_mbit, 0.0, 1.0
    if given_link:
        rate, cpu_per_mb, delays = given_link
        print(f"collective probe not run: {rate:g} Mbit/s, {cpu_per_mb * 1e3:.2f} ms per MB and {delays:g} delays "
              f"per phase from --link", flush=True)
    elif args.simulated_rate == "collective":
        rate, cpu_per_mb, delays = calibrate_link(args.rate_mbit, args.delay_ms, args.probe_bytes, repeats=3)
        print(f"collective probe: {rate:.1f} Mbit/s of the link's {args.rate_mbit:g}, {cpu_per_mb * 1e3:.2f} ms of "
              f"CPU per MB sent, {delays:.2f} one-way delays per phase", flush=True)
    elif args.simulated_rate == "goodput":
        rate = probe_goodput(args.rate_mbit, args.delay_ms, args.probe_bytes, repeats=3)
        print(f"goodput probe: {rate:.1f} Mbit/s of the link's {args.rate_mbit:g}", flush=True)
    step = calibration_step(real, real_dirs, slow=args.slow_factor > 1)
    optimizer = OPTIMIZER_S_PER_PARAM * PARAMS
    microbatch = (step - optimizer) / 2  # wan_bench: two micro-batches of 4 per site step
    if microbatch <= 0:
        raise SystemExit(f"error: the ceiling's step ({step:.3f} s) is shorter than the assumed optimizer step")
    extra = (f"--simulate-clock --simulate-microbatch-seconds {microbatch:.5f} --simulate-optimizer-step-seconds "
             f"{optimizer:.5f} --simulate-inter-site-bandwidth {rate:.2f} "
             f"--simulate-inter-site-latency {args.delay_ms:g} --simulate-transfer-cpu-seconds-per-mb {cpu_per_mb:.6f} "
             f"--simulate-inter-site-delays-per-phase {delays:.4f}")
    sim = bench(os.path.join(args.out_dir, "simulated"), args, extra)
    rows = compare(real, sim)
    header = [f"{datetime.date.today().isoformat()}, `python -m tools.bench validate "
              f"--algorithms {args.algorithms} --repeats {args.repeats} --train-iters {args.train_iters}"
              f" --rate-mbit {args.rate_mbit:g} --delay-ms {args.delay_ms:g}"
              + (f" --slow-factor {args.slow_factor:g}" if args.slow_factor > 1 else "")
              + "".join(f" --algo-args '{a}'" for a in args.algo_args) + "` on "
              f"{os.cpu_count()} CPUs: wan_bench's 7.2M Llama, 2 sites x 1 rank, {args.rate_mbit:g} Mbit/s, "
              f"{args.delay_ms:g} ms one way"
              + (f", site 1 {args.slow_factor:g}x slower (--simulate-slow-ranks 1, real and simulated; compute "
                 f"calibrated from site 0 alone)" if args.slow_factor > 1 else "")
              + f"; {args.repeats} real invocation(s) against one simulated (simulated clock model "
              f"{CLOCK_MODEL}; "
              f"compute calibrated from the real ceiling: micro-batch {microbatch:.4f} s, optimizer step "
              f"{optimizer:.4f} s). The simulated link runs at "
              + {"collective": f"{rate:.1f} Mbit/s, charges {delays:.2f} one-way delays per phase of a collective "
                               f"and {cpu_per_mb * 1e3:.2f} ms of compute per MB sent: what gloo all-reduces of "
                               f"{args.probe_bytes / 1e6:.1f} MB and {LATENCY_PROBE_BYTES} bytes after an idle gap took "
                               "over the emulated link and the CPU the first kept busy (tools/wan/collective_probe.py, "
                               "median of 3" + (", from an earlier probe: --link" if args.link else "") + ")",
                 "goodput": f"{rate:.1f} Mbit/s, the goodput a bulk probe measured over the emulated link "
                            f"({args.probe_bytes / 1e6:.1f} MB each way at once, median of 3; TCP headers, "
                            "acknowledgements and congestion control take the rest), no CPU charged for transfers",
                 "line": f"the line rate, {rate:g} Mbit/s, no CPU charged for transfers"}[args.simulated_rate]
              + ". Time per step excludes the first log interval. The bar: within 10% in both columns."]
    text = table(rows, header)
    os.makedirs(os.path.dirname(args.doc), exist_ok=True)
    earlier = ""
    if args.append and os.path.exists(args.doc):
        with open(args.doc, encoding="utf-8") as f:
            earlier = f.read() + "\n"
    write_text(args.doc, earlier + text + "\n")
    write_json(os.path.join(results_path(args.out_dir), "validation.json"),
               {"rows": rows, "microbatch_s": microbatch, "optimizer_s": optimizer, "rate_mbit": rate,
                "cpu_seconds_per_mb": cpu_per_mb, "delays_per_phase": delays, "slow_factor": args.slow_factor,
                "delay_ms": args.delay_ms, "link_rate_mbit": args.rate_mbit, "clock_model": CLOCK_MODEL}, indent=1)
    print(text)
    print(f"wrote {args.doc}; `python -m tools.bench board --cached-only` puts it in docs/leaderboard.md")
    return 0


if __name__ == "__main__":
    with tool_errors():
        sys.exit(main())
