#!/usr/bin/env python
"""Which algorithm, with which settings, trains my model fastest over my link?

    python tools/plan.py --sites 2 --gpus-per-site 8 --sustained-tflops 400 --rate-mbit 1000 \\
        --latency-ms 30 --params 1e9 --tokens-per-step 131072 --total-tokens 20e9
    python tools/plan.py --job tools/benchmarks/scenarios/2x8gpu-1gbit-1b.toml --json plan.json

For every algorithm it runs a short pilot on the simulated clock (the leaderboard's pilot:
the real synchronizer, a tiny stand-in GPT whose cross-site bytes are charged as the target
model's, tools/planning/pilots.py), and from it states the time per step, the exposed
communication and the cross-site bytes per step. Memory per GPU comes from the layout
(tools/planning/memory.py), quality from the project's measured evidence, labelled with
where it was measured (tools/planning/evidence.py). The ranking is by predicted time to
sync's loss: time per step x steps x the measured token multiplier; for an algorithm without a
measured multiplier (it did not reach sync's loss where it was measured) that is only a lower
bound (x 1, or x the most tokens it was trained on without reaching it), shown with ">=".
Rows with a measured time rank first; the bounds follow, each with the multiplier below which
it would beat the first row.
The job is given by flags or by a TOML file in the
leaderboard's scenario format with [model] and [job] tables (tools/planning/job.py); flags
given beside --job override it. docs/planning.md has worked examples.

A tool, not part of the package (`python -m megatron_lsgd.plan` would be): it drives the
leaderboard's pieces, which live under tools/benchmarks.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

if __package__:  # python -m tools.plan, python -m tools.bench plan: the checkout is on the path
    from tools import _bootstrap
else:  # python tools/plan.py: tools/ is, the checkout not yet
    import _bootstrap  # noqa: F401
from megatron_lsgd import cli
from megatron_lsgd.training.scenario import load_scenario
from megatron_lsgd.core.output_files import write_text
from tools.benchmarks.recipes import ALGORITHMS
from tools.planning.evidence import (Evidence, at_interval, far_beyond, figure_key, interval_of, load_all,
                                     nearest)
from tools.planning.job import Job, Model, job_from_toml
from tools.planning.memory import GIB, memory_per_gpu
from tools.planning.pilots import (GRID_COMPRESSION, GRID_COMPRESSIONS, Pace, base_pilot, grid, ranks_output_to,
                                   run_pilots)

EVIDENCE = os.path.join(_bootstrap.REPO_ROOT, "results", "quality*.json")  # the quality pages' raw JSON


def parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(description=__doc__, formatter_class=cli.HelpFormatter)
    p.add_argument("--job", metavar="FILE", help="a job TOML (a leaderboard scenario, optionally with [model], [job])")
    p.add_argument("--sites", type=int)
    p.add_argument("--gpus-per-site", type=_ints, help="one number, or one per site (comma-separated)")
    p.add_argument("--sustained-tflops", type=float, help="achieved TFLOP/s per GPU (e.g. 400 for an H100 at 40%%)")
    p.add_argument("--step-seconds", type=float, help="or: a measured compute time of one step of a site")
    p.add_argument("--site-factors", type=_floats, help="compute slowdown per site (1 = nominal; default 1)")
    p.add_argument("--rate-mbit", type=_floats, help="link rate, one for all sites or one per site")
    p.add_argument("--latency-ms", type=_floats, help="one-way delay, one for all or one per site (default 0)")
    p.add_argument("--params", type=float, help="the model's parameter count (or give its shape)")
    p.add_argument("--num-layers", type=int)
    p.add_argument("--hidden-size", type=int)
    p.add_argument("--num-attention-heads", type=int)
    p.add_argument("--num-query-groups", type=int)
    p.add_argument("--ffn-hidden-size", type=int)
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--tokens-per-step", type=float, help="tokens of one step, every site together")
    p.add_argument("--total-tokens", type=float, help="tokens to train (default: 20 per parameter)")
    p.add_argument("--seq-length", type=int)
    p.add_argument("--micro-batch-size", type=int)
    p.add_argument("--tensor-parallel", type=_ints, help="one for every site, or one per site (comma-separated; "
                   "sites of different layouts: docs/heterogeneous_sites.md); default 1")
    p.add_argument("--pipeline-parallel", type=_ints, help="likewise (default 1)")
    p.add_argument("--recompute", choices=["none", "selective", "full"], help="activation recomputation")
    p.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory of one GPU, for the warning")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma-separated")
    p.add_argument("--pilot-steps", type=int, default=None,
                   help="at least this many steps per pilot, in whole intervals of the algorithm (default: the "
                        "leaderboard's pilot length for round-based algorithms, whose pace then is the board's; "
                        "50 for the others)")
    p.add_argument("--grid", action="store_true",
                   help="also a row for each setting moved away from the recommended ones, one at a time: a "
                        "round-based algorithm at half and twice its H; streaming-diloco and cocodc at 1 and 4 "
                        "fragments (where they cut H into slots longer than tau); an algorithm that takes a "
                        "compressor at each of --grid-compressions (dilocox, recommended int4: also uncompressed; with sites "
                        "of different sizes only where the algorithm weights it by tokens). Not the "
                        "inter-site backend: the simulated clock charges nccl and gloo alike")
    p.add_argument("--grid-compressions", type=_names, default=",".join(GRID_COMPRESSION), metavar="LIST",
                   help=f"with --grid, the compressors tried on what takes one (comma-separated, of "
                        f"{', '.join(GRID_COMPRESSIONS)}; default %(default)s). Not lowrank-int4: its bytes follow "
                        "the matrices' shapes, which the stand-in's do not share with your model's")
    p.add_argument("--evidence", default=EVIDENCE, help="glob of quality JSON files (quality_frontier.py's)")
    p.add_argument("--json", metavar="FILE", help="also write the plan as JSON ('-': stdout, no table)")
    return p


def _ints(text: str) -> List[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise cli.argparse.ArgumentTypeError(f"{text!r} is not a whole number or a comma-separated list of them")


def _names(text: str) -> List[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _floats(text: str) -> List[float]:
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise cli.argparse.ArgumentTypeError(f"{text!r} is not a number or a comma-separated list of numbers")


def job_from_args(a) -> Job:
    model_flags = dict(params=a.params, num_layers=a.num_layers, hidden_size=a.hidden_size,
                       num_attention_heads=a.num_attention_heads, num_query_groups=a.num_query_groups,
                       ffn_hidden_size=a.ffn_hidden_size)
    if a.vocab_size is not None:
        model_flags["vocab_size"] = a.vocab_size
    overrides = dict(tokens_per_step=a.tokens_per_step, total_tokens=a.total_tokens, seq_length=a.seq_length,
                     micro_batch_size=a.micro_batch_size, tensor_parallel=a.tensor_parallel,
                     pipeline_parallel=a.pipeline_parallel, recompute=a.recompute, gpu_memory_gb=a.gpu_memory_gb,
                     sustained_tflops=a.sustained_tflops, step_seconds=a.step_seconds)
    sites = a.sites
    if a.job:
        if sites is not None or a.gpus_per_site or a.rate_mbit or a.latency_ms or a.site_factors:
            raise ValueError("--job: give sites, GPUs and links in the file, not as flags beside it")
        if a.params is not None or a.num_layers is not None:
            raise ValueError("--job: give the model in the file's [model] table, not as flags beside it")
        if a.sustained_tflops is not None or a.step_seconds is not None:
            raise ValueError("--job: give the compute in the file's [compute] table, not as flags beside it")
        return job_from_toml(a.job, overrides)
    if sites is None:
        raise ValueError("--sites is required (or --job FILE)")
    if not a.rate_mbit:
        raise ValueError("--rate-mbit is required (or --job FILE)")
    if a.tokens_per_step is None:
        raise ValueError("--tokens-per-step is required (or --job FILE)")

    def spread(values, default, flag):
        values = values or [default]
        if len(values) not in (1, sites):
            raise ValueError(f"{flag} has {len(values)} values for {sites} sites")
        return values * sites if len(values) == 1 else values

    model = Model(**{k: v for k, v in model_flags.items() if v is not None})
    job = Job(sites=sites, gpus_per_site=spread(a.gpus_per_site, 1, "--gpus-per-site"),
              rate_mbit=spread(a.rate_mbit, 0.0, "--rate-mbit"), latency_ms=spread(a.latency_ms, 0.0, "--latency-ms"),
              site_factors=spread(a.site_factors, 1.0, "--site-factors"), model=model,
              tokens_per_step=a.tokens_per_step, total_tokens=a.total_tokens or 0.0)
    for key, value in overrides.items():
        if value is not None and key != "total_tokens":
            setattr(job, key, value)
    if not a.total_tokens and (model.params or model.has_shape):
        job.total_tokens = 20 * job.params
        job.notes.append(f"--total-tokens not given: 20 tokens per parameter assumed ({job.total_tokens:.3g})")
    job.validate()
    return job


def settings_flags(pace: Pace) -> List[str]:
    return ["--lsgd-algorithm", pace.algorithm] + pace.settings


def pretrain_flags(job: Job, pace: Pace) -> str:
    """The flags one site's `pretrain_gpt.py` needs for this plan (besides model and data)."""
    micro = job.micro_batch_size
    global_batch = round(job.tokens_per_step / job.seq_length)
    sites = range(job.sites)
    layout = [f"--site-tensor-model-parallel-sizes {','.join(str(job.tp(s)) for s in sites)}",
              f"--site-pipeline-model-parallel-sizes {','.join(str(job.pp(s)) for s in sites)}"] \
        if job.mixed_layouts else [f"--tensor-model-parallel-size {job.tp()}",
                                   f"--pipeline-model-parallel-size {job.pp()}"]
    flags = [f"--num-sites {job.sites}", *layout, f"--seq-length {job.seq_length}",
             f"--micro-batch-size {micro}", f"--global-batch-size {global_batch}",
             f"--train-tokens {int(job.total_tokens)}", "--use-distributed-optimizer", "--bf16"]
    if job.unequal:
        flags.append("--site-data-parallel-sizes " + ",".join(str(job.dp_intra(s)) for s in sites))
    if any(job.tp(s) > 1 for s in sites):
        flags.append("--sequence-parallel")
    if job.recompute != "none":
        flags.append(f"--recompute-granularity {job.recompute}")
        if job.recompute == "full":
            flags.append("--recompute-method uniform --recompute-num-layers 1")
    flags += [" ".join(settings_flags(pace))]
    if pace.algorithm in ("acco", "dpu"):
        flags.append("--inter-site-backend gloo")  # their worker thread's groups (docs/algorithms/acco.md)
    return " ".join(flags)


def quality(job: Job, algorithm: str, evidence: List[Evidence], compression: str = "none",
            interval: Optional[int] = None) -> Dict:
    """The measured token multiplier to reach sync's loss, with its provenance. A row with a
    compressor takes only a point measured with that compressor: the uncompressed point's
    multiplier would rank (and recommend) it as measured for a loss nobody measured."""
    if algorithm == "sync" and compression == "none":
        return {"multiplier": 1.0, "source": "the reference (sync's loss is the target)", "far": []}
    key = figure_key(algorithm, compression)
    if algorithm == "sync":  # compressed gradients: not the reference, and never measured
        return {"multiplier": None, "source": f"sync with --lsgd-compression {compression}: not measured", "far": []}
    tpp = job.total_tokens / job.params
    e = nearest(evidence, key, job.params, tpp)
    if e is None:
        if compression == "none":
            return {"multiplier": None, "source": "no measured evidence for this algorithm", "far": []}
        plain = quality(job, algorithm, evidence)["source"]
        return {"multiplier": None, "far": [],
                "source": f"{algorithm} with --lsgd-compression {compression}: not measured (uncompressed: {plain})"}
    fig = at_interval(e, key, interval)
    measured_h = interval_of(fig.point)
    return {"multiplier": fig.multiplier, "final_gap": fig.final_gap, "point": fig.point, "seeds": fig.seeds,
            "at_least": fig.at_least, "how": fig.how, "source": e.label(), "far": far_beyond(e, job.params, tpp),
            # the row runs another H than the point measured: said beside the multiplier
            **({"measured_interval": measured_h} if interval and measured_h and measured_h != interval else {})}


def warnings_for(job: Job, pace: Pace, memory_total: float, sync_pace: Optional[Pace]) -> List[str]:
    out = []
    if memory_total > job.gpu_memory_gb * GIB:
        out.append(f"memory {memory_total / GIB:.1f} GiB per GPU exceeds {job.gpu_memory_gb:g} GB: more "
                   f"--tensor-parallel/--pipeline-parallel or --recompute full")
    if pace.seconds_per_step > 0 and pace.exposed_seconds_per_step > 0.5 * pace.seconds_per_step:
        out.append(f"communication is {100 * pace.exposed_seconds_per_step / pace.seconds_per_step:.0f}% of each "
                   f"step: its interval never hides the exchange on this link")
    if pace.algorithm == "sync" and sync_pace and pace.exposed_seconds_per_step > pace.seconds_per_step / 2:
        out.append("the link is too slow for per-step gradient exchange")
    return out


def refusals(job: Job, algorithms: List[str]) -> Dict[str, str]:
    """The algorithms that refuse this job's sites of different sizes or layouts, with their
    reasons (each synchronizer's `unequal_sites_refusal`, `mixed_layouts_refusal`: the line
    pretrain_gpt.py would print)."""
    from megatron_lsgd.core.lsgd.catalog import refusals as refused_by

    out: Dict[str, str] = {}
    for shape, attribute in ((job.unequal, "unequal_sites_refusal"), (job.mixed_layouts, "mixed_layouts_refusal")):
        for algorithm, why in (refused_by(attribute, algorithms) if shape else {}).items():
            out.setdefault(algorithm, why)
    return out


def memory_for(job: Job, algorithm: str, compression: str, microbatches: int):
    """Memory per GPU on the site that needs the most (the fewest GPUs per replica's shards, or
    the layout that leaves each GPU the most)."""
    hidden = job.model.hidden_for_memory()
    return max((memory_per_gpu(job.params, job.tp(s), job.pp(s), job.dp_intra(s), algorithm, compression,
                               outer_momentum=False, seq=job.seq_length, micro_batch=job.micro_batch_size,
                               hidden=hidden, heads=job.model.num_attention_heads or max(1, hidden // 128),
                               layers=job.model.layers_for_memory(), recompute=job.recompute,
                               microbatches=microbatches) for s in range(job.sites)), key=lambda m: m.total)


def plan(job: Job, algorithms: List[str], pilot_steps: Optional[int], evidence_glob: str, log_path: str,
         with_grid: bool = False, compressions: Sequence[str] = GRID_COMPRESSION) -> Dict:
    evidence = load_all(evidence_glob)
    refused = refusals(job, algorithms)
    algorithms = [a for a in algorithms if a not in refused]
    if not algorithms:
        raise ValueError("--algorithms: every one refuses these sites of different sizes or layouts "
                         f"(--gpus-per-site {job.gpus_per_site}, --tensor-parallel {job.tensor_parallel}, "
                         f"--pipeline-parallel {job.pipeline_parallel}): "
                         + "; ".join(f"{a}: {why}" for a, why in refused.items()))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "job.toml")
        write_text(path, job.scenario_toml())
        scenario = load_scenario(path)
        say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
        with ranks_output_to(log_path):
            # sites of different layouts exchange in the layout-free form, which is not compressed
            uncompressed = job.mixed_layouts
            pilots = grid(algorithms, scenario, uncompressed, compressions) if with_grid else \
                [base_pilot(a, scenario, uncompressed) for a in algorithms]
            paces = run_pilots(algorithms, path, scenario, pilot_steps, progress=say, pilots=pilots)
    microbatches = job.microbatches()
    rows = []
    for label, pace in paces.items():
        if pace is None:
            continue
        algorithm = pace.algorithm
        s = pace.settings  # the pilot's: its recipe's recommended flags, a grid point's in their place
        compression = s[s.index("--lsgd-compression") + 1] if "--lsgd-compression" in s else "none"
        interval = int(s[s.index("--lsgd-interval") + 1]) if "--lsgd-interval" in s else None
        mem = memory_for(job, algorithm, compression, microbatches)
        q = quality(job, algorithm, evidence, compression, interval)
        train_seconds = pace.seconds_per_step * job.steps
        # without a measured multiplier only a lower bound: the tokens' time (x 1), or x the largest
        # budget that was measured not to reach sync's loss
        to_loss = train_seconds * (q["multiplier"] if q["multiplier"] is not None else q.get("at_least") or 1.0)
        rows.append({"algorithm": algorithm, "label": label, "flags": settings_flags(pace), "pilot_steps": pace.steps,
                     "seconds_per_step": pace.seconds_per_step,
                     "exposed_comm_seconds_per_step": pace.exposed_seconds_per_step,
                     "cross_site_bytes_per_step": pace.cross_site_bytes_per_step,
                     "cross_site_bytes_per_run": pace.cross_site_bytes_per_step * job.steps,
                     "memory_gib": {k: v / GIB for k, v in mem.as_dict().items()}, "memory_total_gib": mem.total / GIB,
                     "train_seconds": train_seconds, "quality": q, "seconds_to_sync_loss": to_loss,
                     "seconds_to_sync_loss_is_lower_bound": q["multiplier"] is None,
                     "pretrain_gpt_flags": pretrain_flags(job, pace),
                     "warnings": warnings_for(job, pace, mem.total, paces.get("sync"))})
    rank(rows)
    return {"job": {"description": job.description, "sites": job.sites, "gpus_per_site": job.gpus_per_site,
                    "rate_mbit": job.rate_mbit, "latency_ms": job.latency_ms, "site_factors": job.site_factors,
                    "params": job.params, "tokens_per_step": job.tokens_per_step, "total_tokens": job.total_tokens,
                    "steps": job.steps, "tensor_parallel": job.tensor_parallel,
                    "pipeline_parallel": job.pipeline_parallel, "recompute": job.recompute, "notes": job.notes},
            "scenario": job.scenario_toml(), "evidence": [e.label() for e in evidence], "rows": rows,
            "refused": refused,
            "timing": "simulated clock (core/simulation.py) running each real synchronizer on the leaderboard's "
                      "stand-in GPT, cross-site bytes scaled to the target"}


def rank(rows: List[Dict]) -> None:
    """Rows whose time to sync's loss is measured first, fastest first; then the lower bounds, by
    their bound. A bound says nothing of how much longer the row takes, so ranking it by its
    bound above a measured row would recommend a row that may never reach sync's loss over one
    that does (dilocox ends +13.6% above it at 20 tokens per parameter). Each bound row gets the
    token multiplier below which it would beat the first row (`beats_first_below`); where its
    bound already exceeds that, it cannot (`beats_first` False; None where its quality is
    unmeasured)."""
    rows.sort(key=lambda r: (r["seconds_to_sync_loss_is_lower_bound"], r["seconds_to_sync_loss"]))
    first = rows[0] if rows and not rows[0]["seconds_to_sync_loss_is_lower_bound"] else None
    for r in rows:
        if first is None or not r["seconds_to_sync_loss_is_lower_bound"]:
            continue
        q = r["quality"]
        # measured not to reach sync's loss at x 1 (or at its largest budget): it needs more than that
        bound = q.get("at_least") or (1.0 if "final_gap" in q else None)
        tie = first["seconds_to_sync_loss"] / r["train_seconds"]
        r["beats_first_below"] = tie
        r["beats_first"] = None if bound is None else tie > bound  # None: unmeasured, nothing known


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


def _beats_first(row: Dict) -> str:
    if "beats_first_below" not in row:
        return ""
    tie = f"{row['beats_first_below']:.3g}"
    if row["beats_first"] is None:
        return f"{tie} (quality unmeasured)"
    if row["beats_first"]:
        return tie
    q = row["quality"]
    return f"no (needs > {q.get('at_least') or 1:g}, ties at {tie})"


def _differing_rows(rows: List[Dict], key: str) -> List[Dict]:
    """Per algorithm, its recommended row and each grid row whose `key` (memory, quality)
    differs from it (a compressor's residual, compressed sync's unmeasured quality), under its
    own label; in the ranking's order."""
    base = {r["algorithm"]: r for r in rows if r["label"] == r["algorithm"]}
    out, seen = [], set()
    for r in rows:
        ref = base.get(r["algorithm"], r)
        shown = ref if r[key] == ref[key] else r
        if id(shown) not in seen:
            seen.add(id(shown))
            out.append(shown)
    return out


def table(result: Dict) -> str:
    job = result["job"]
    gpus = job["gpus_per_site"]
    per_site = str(gpus[0]) if len(set(gpus)) == 1 else "+".join(map(str, gpus))
    tp, pp = (str(v[0]) if len(set(v)) == 1 else ",".join(map(str, v))
              for v in (job["tensor_parallel"], job["pipeline_parallel"]))
    lines = [f"job: {job['sites']} sites x {per_site} GPUs, links {job['rate_mbit']} Mbit/s "
             f"{job['latency_ms']} ms, slowdowns {job['site_factors']}, {job['params'] / 1e9:.3g}B params, "
             f"{job['tokens_per_step']:.3g} tokens/step, {job['total_tokens']:.3g} tokens = {job['steps']} steps, "
             f"TP {tp} PP {pp}, recompute {job['recompute']}"]
    lines += [f"note: {n}" for n in job["notes"]]
    lines += [f"timing: {result['timing']}", "",
              "| rank | algorithm | s/step | exposed comm s/step | cross-site GB/step | cross-site TB/run | "
              "GiB/GPU | time for the tokens | tokens x to sync's loss | time to sync's loss | "
              "beats rank 1 below tokens x |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(result["rows"], 1):
        q = r["quality"]
        mult = f"{q['multiplier']:.2f}" if q["multiplier"] is not None else \
            f"> {q['at_least']:g} ({100 * q['final_gap']:+.1f}% loss at 1x)" if q.get("at_least") else \
            f"not reached ({100 * q.get('final_gap', 0):+.1f}% loss)" if "final_gap" in q else "unmeasured"
        if "measured_interval" in q:
            mult += f" (at H={q['measured_interval']})"
        to = (">= " if r["seconds_to_sync_loss_is_lower_bound"] else "") + _duration(r["seconds_to_sync_loss"])
        lines.append(f"| {i} | {r['label']} | {r['seconds_per_step']:.4g} | {r['exposed_comm_seconds_per_step']:.4g} "
                     f"| {r['cross_site_bytes_per_step'] / 1e9:.4g} | {r['cross_site_bytes_per_run'] / 1e12:.4g} "
                     f"| {r['memory_total_gib']:.1f} | {_duration(r['train_seconds'])} | {mult} | {to} "
                     f"| {_beats_first(r)} |")
    lines += ["", "quality evidence (per algorithm: the measurement nearest this job; a grid row's settings are "
                  "its pace's, its multiplier the measured point's):"]
    for r in _differing_rows(result["rows"], "quality"):
        q = r["quality"]
        far = f"; FAR BEYOND WHAT WAS MEASURED: {', '.join(q['far'])}, the multiplier is not extrapolated" \
            if q["far"] else ""
        point = f" (point {q['point']}, seeds {','.join(q['seeds'])}; multiplier from {q['how']})" \
            if "point" in q else ""
        lines.append(f"- {r['label']}: {q['source']}{point}{far}")
    smallest = " on the site that needs the most" if len(set(gpus)) > 1 or "," in tp + pp else ""
    lines += ["", f"memory per GPU{smallest} (GiB: weights / gradients / optimizer / outer state / compressor / "
                  "algorithm buffers / activations):"]
    for r in _differing_rows(result["rows"], "memory_gib"):
        m = r["memory_gib"]
        lines.append(f"- {r['label']}: " + " / ".join(f"{v:.2f}" for v in m.values()))
    if result.get("refused"):
        lines += ["", "not planned (they refuse these sites of different sizes or layouts, "
                      "docs/heterogeneous_sites.md):"]
        lines += [f"- {a}: {why}" for a, why in result["refused"].items()]
    warned = [(r["label"], w) for r in result["rows"] for w in r["warnings"]]
    if warned:
        lines += ["", "warnings:"] + [f"- {a}: {w}" for a, w in warned]
    if result["rows"]:
        best = result["rows"][0]
        bounds = [r for r in result["rows"] if r["seconds_to_sync_loss_is_lower_bound"]]
        if best["seconds_to_sync_loss_is_lower_bound"]:
            lines += ["", f"note: {best['label']}'s time to sync's loss is a lower bound: where it was measured it "
                          f"did not reach sync's loss (see its quality evidence); no row's time is measured"]
        elif bounds:
            lines += ["", f"note: rows with a lower bound (>=) rank after every measured one, by their bound; the "
                          f"last column is the token multiplier below which each would beat {best['label']}, "
                          f"'no' where its measured bound already exceeds it"]
        gaps = sorted((r["quality"]["final_gap"], r["label"]) for r in _differing_rows(bounds, "quality")
                      if "final_gap" in r["quality"])
        if len(gaps) > 1:  # lower bounds rank by their tokens' time alone: say what each gives up
            lines.append("note: rows with a lower bound are ranked by the time for the tokens alone; the loss "
                         "each ended at, against sync's, where measured: "
                         + ", ".join(f"{label} {100 * gap:+.1f}%" for gap, label in gaps))
        lines += ["", f"recommended ({best['label']}), on every site:",
                  f"  python pretrain_gpt.py <model and data flags> {best['pretrain_gpt_flags']}"]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    a = parser().parse_args(argv)
    with cli.user_errors():
        algorithms = a.algorithms.split(",")
        unknown = [x for x in algorithms if x not in ALGORITHMS]
        if unknown:
            raise ValueError(f"--algorithms: {unknown[0]!r} is not one of {', '.join(ALGORITHMS)}")
        bad = [c for c in a.grid_compressions if c not in GRID_COMPRESSIONS]
        if bad or not a.grid_compressions:
            why = " (its bytes follow the matrices' shapes, which the stand-in's do not share with the model's)" \
                if "lowrank-int4" in bad else ""
            raise ValueError(f"--grid-compressions: {bad[0] if bad else 'empty'!r} is not one of "
                             f"{', '.join(GRID_COMPRESSIONS)}{why}")
        if a.grid_compressions != list(GRID_COMPRESSION) and not a.grid:
            raise ValueError("--grid-compressions: only with --grid (the rows it adds are grid rows)")
        if a.pilot_steps is not None and a.pilot_steps < 1:
            raise ValueError(f"--pilot-steps {a.pilot_steps}: must be >= 1")
        job = job_from_args(a)
        start = time.monotonic()
        log = os.path.join(tempfile.gettempdir(), f"plan-pilots-{os.getpid()}.log")
        print(f"> pilots on the simulated clock (their ranks' logs: {log})", file=sys.stderr)
        result = plan(job, algorithms, a.pilot_steps, a.evidence, log, with_grid=a.grid,
                      compressions=a.grid_compressions)
        result["real_seconds"] = round(time.monotonic() - start, 1)
        print(f"> planned in {result['real_seconds']} s of real time", file=sys.stderr)
        if a.json:
            text = json.dumps(result, indent=1)
            if a.json == "-":
                print(text)
                return
            write_text(a.json, text + "\n")
        print(table(result))


if __name__ == "__main__":
    main()
