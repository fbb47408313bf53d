"""Quality at equal tokens: sync, diloco, dilocox, acco, dpu, dreamddp, streaming-diloco, cocodc, edit, a-edit across sites (CPU/gloo or GPU).

Runs each algorithm in `--sites` x `--ranks-per-site` spawned processes on the same data,
model, seed and token budget, and writes a Markdown table (final validation loss and its
gap to sync, inter-site bytes actually sent by the rank that logs, ratio to sync, exposed
communication, tokens/s) plus a PNG of training and validation loss curves, both into
--out-dir, and the raw results (lsgd_quality.json) under results/ for an --out-dir in docs/
(results/algorithms/results for the default docs/algorithms/results), into --out-dir elsewhere.

    python -m tools.bench quality --data-path data/python-docs/..._text_document \\
        --tokenizer-model data/python-docs/tokenizer.model --out-dir docs/algorithms/results

Without --data-path (or if it does not exist) it runs on --mock-data and says so in
every output.

The built-in runs are the recipes' (tools/benchmarks/recipes.py): each algorithm's default,
labelled by its name, and its named variants (dilocox-int4, edit-nopenalty, ...), at this
tool's knobs (--interval, --outer-lr, ...). Any run's flags can be extended, or a new labelled
run defined, with `--run-args LABEL=FLAGS` (a new label's FLAGS name its --lsgd-algorithm;
`LABEL@RUN=FLAGS` is RUN's flags followed by FLAGS, later flags winning). With `--eval-interval N`
validation runs every N iterations, and `--target RUN` adds a table of the iterations each
run needs to reach RUN's final validation loss (linear interpolation between evaluations)
and a plot of the validation curves, e.g. for CoCoDC against Streaming DiLoCo at 4 sites:

    python -m tools.bench quality --sites 4 --num-layers 4 --interval 100 \\
        --runs streaming-diloco,cocodc --eval-interval 50 --target streaming-diloco ...

a-edit syncs by wall-clock time (--aedit-seconds) and its sites may take different numbers
of steps, so it gets the same budget as a number of samples (--train-samples) instead of
--train-iters; its training curve is the logging site's own.

`--extra-args` adds flags to every run, e.g. a simulated slow link
(`--simulate-inter-site-bandwidth 100 --simulate-inter-site-latency 20`), which decides
what dreamddp's bubble filling can add for free.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from typing import Dict, List, Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)

from megatron_lsgd import cli  # noqa: E402
from megatron_lsgd.core.datasets import IndexedDataset, parse_split, split_ranges  # noqa: E402
from megatron_lsgd.core.lsgd.catalog import synchronizer_class  # noqa: E402
from megatron_lsgd.training.arguments import build_config, parse_args  # noqa: E402
from megatron_lsgd.training.initialize import free_port  # noqa: E402
from megatron_lsgd.core.output_files import save_figure, write_json, write_text  # noqa: E402
from tools.benchmarks.recipes import quality_runs  # noqa: E402
from tools.benchmarks.resumable_runs import WorkDir, joined, segment_argv  # noqa: E402
from tools.benchmarks.run_cache import code_version, positive_int, results_path  # noqa: E402
from tools.benchmarks.spawned_ranks import run_ranks, run_tool  # noqa: E402


def _worker(rank: int, world: int, port: int, argv: List[str], out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import pretrain_gpt
    from megatron_lsgd.training.initialize import shutdown_distributed

    t0 = time.perf_counter()
    result = pretrain_gpt.main(argv)
    if rank == world - 1:  # the logging rank
        write_json(out, {"train": result.logged_losses, "valid": result.validation_losses,
                         "comm": result.comm, "stats": result.sync_stats, "tokens_per_s": result.tokens_per_second,
                         "seconds": time.perf_counter() - t0})
    shutdown_distributed()


def run(argv: List[str], world: int, work_dir: Optional[str] = None) -> Dict:
    """One run's result. With `work_dir` a lockstep run checkpoints there and, stopped, resumes
    from its last checkpoint when run again (resumable_runs.py); the directory goes when it ends."""
    if work_dir is None or not lockstep(argv):  # a-edit's sites log into one file each: not joined
        return _run_once(argv, world)
    work = WorkDir(work_dir)
    argv = segment_argv(argv, work.begin_segment(code_version()))
    try:
        final = _run_once(argv, world)
    except Exception:
        if work.resumed():  # a checkpoint this code cannot resume would fail every time: start afresh next time
            print(f"  the run failed after resuming: {work_dir} is removed, the next attempt starts at step 0",
                  flush=True)
            work.discard()
        raise
    result = joined(work.segments(), final)
    if len(work.codes()) > 1:
        result["segment_codes"] = work.codes()
    work.discard()
    return result


def _run_once(argv: List[str], world: int) -> Dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        run_ranks(_worker, (world, free_port(), argv, out), world)
        with open(out) as f:
            return json.load(f)


def lockstep(argv: List[str]) -> bool:
    """Whether the run's algorithm (its last --lsgd-algorithm) keeps the sites in lockstep."""
    names = [argv[i + 1] for i, a in enumerate(argv) if a == "--lsgd-algorithm"]
    return synchronizer_class(names[-1] if names else "sync").lockstep


SPLIT = "98,2,0"  # train, validation, test: the runs' --split


def data_argv(data_path, tokenizer_model, valid_data_path=None):
    """(flags, label): the corpus when `data_path`.bin exists, else mock data, said loudly. With
    `valid_data_path` (a held-out file), `data_path` is the training set used whole."""
    if valid_data_path is not None:
        for flag, path in (("--data-path", data_path), ("--valid-data-path", valid_data_path)):
            if not path or not os.path.exists(path + ".bin"):
                raise ValueError(f"{flag} {path}: no such .bin/.idx prefix")
        return (["--train-data-path", data_path, "--valid-data-path", valid_data_path, "--tokenizer-type",
                 "SentencePieceTokenizer", "--tokenizer-model", tokenizer_model],
                f"real corpus {data_path}, validation on held-out documents {valid_data_path}")
    if data_path and os.path.exists(data_path + ".bin"):
        return (["--data-path", data_path, "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                 tokenizer_model, "--split", SPLIT], f"real corpus {data_path}")
    return ["--mock-data", "--vocab-size", "512"], "MOCK DATA (synthetic tokens; not the real corpus)"


def passes_note(data_path, samples: int, seq_length: int, whole: bool = False) -> str:
    """' (N train tokens, read P times)' for the corpus of data_argv, '' for mock data: past one
    pass the model sees repeated data, and a gap between runs is partly a gap in fitting it."""
    if not (data_path and os.path.exists(data_path + ".bin")):
        return ""
    indexed = IndexedDataset(data_path)
    start, end = (0, len(indexed)) if whole else split_ranges(len(indexed), parse_split(SPLIT))[0]
    tokens = int(indexed.sequence_lengths[start:end].astype("int64").sum())
    passes = samples * seq_length / tokens
    if passes < 1:  # a share of the file, each token once ("read 0.05 times" reads as a misprint)
        return f" ({tokens:,} train tokens, {100 * passes:.1f}% of them read once)"
    return f" ({tokens:,} train tokens, read {passes:.2f} times)"


def base_argv(*, num_layers: int, hidden_size: int, seq_length: int, global_batch_size: int, train_iters: int,
              lr: float, eval_interval: int, eval_iters: int, sites: int, data: List[str], extra: List[str],
              seed: int = 1234) -> List[str]:
    """The model, schedule and data every compared run shares (a small Llama-style GPT)."""
    return ["--num-layers", str(num_layers), "--hidden-size", str(hidden_size),
            "--num-attention-heads", "4", "--seq-length", str(seq_length), "--micro-batch-size", "4",
            "--global-batch-size", str(global_batch_size), "--train-iters", str(train_iters),
            "--lr", str(lr), "--min-lr", str(lr / 10), "--lr-decay-style", "cosine",
            "--lr-warmup-iters", str(train_iters // 20), "--weight-decay", "0.1", "--clip-grad", "1.0",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "10",
            "--eval-interval", str(eval_interval or train_iters), "--eval-iters", str(eval_iters),
            "--seed", str(seed),
            "--num-sites", str(sites), "--normalization", "RMSNorm", "--position-embedding-type", "rope",
            "--swiglu", "--disable-bias-linear"] + data + extra


def steps_to_reach(iters: List[int], losses: List[float], target: float):
    """First iteration at which the validation curve reaches `target`, linearly interpolated
    between evaluations (None if it never does)."""
    prev_it, prev = None, None
    for it, loss in zip(iters, losses):
        if loss <= target:
            if prev is None or prev == loss:
                return float(it)
            return prev_it + (it - prev_it) * (prev - target) / (prev - loss)
        prev_it, prev = it, loss
    return None


def parser() -> argparse.ArgumentParser:
    """The tool's arguments; their defaults are the knobs of the recipes' runs (recipes.quality_runs)."""
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-path", default=None)
    p.add_argument("--tokenizer-model", default=None)
    p.add_argument("--out-dir", default="docs/algorithms/results",
                   help="the table (lsgd_quality.md) and its PNG; the raw lsgd_quality.json goes to the same path "
                        "under results/ when this is in docs/ (default: results/algorithms/results), else here")
    p.add_argument("--sites", type=positive_int, default=2)
    p.add_argument("--ranks-per-site", type=positive_int, default=1)
    p.add_argument("--train-iters", type=positive_int, default=600)
    p.add_argument("--interval", type=positive_int, default=50, help="H for diloco, dilocox and dreamddp")
    p.add_argument("--num-layers", type=positive_int, default=2)
    p.add_argument("--hidden-size", type=positive_int, default=64)
    p.add_argument("--seq-length", type=positive_int, default=64)
    p.add_argument("--global-batch-size", type=positive_int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-iters", type=positive_int, default=10)
    p.add_argument("--runs", default="sync,diloco,dilocox-int4,dilocox-lowrank-int4,acco,dpu,dreamddp")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--dilocox-outer-momentum", type=float, default=0.5,
                   help="outer momentum for dilocox runs (a one-round-late Δ̄ with 0.9 oscillated in our runs)")
    p.add_argument("--restart", choices=["eager", "anchor"], default="eager", help="--lsgd-dilocox-restart")
    p.add_argument("--rank", type=int, default=8, help="--lsgd-rank for dilocox-lowrank-int4")
    p.add_argument("--apply-step", type=int, default=0,
                   help="--lsgd-dilocox-apply-step for dilocox runs (0: H, the one-round delay)")
    p.add_argument("--fragments", type=int, default=4, help="--lsgd-fragments for streaming-diloco and cocodc")
    p.add_argument("--fragment-partition", default="strided", help="--lsgd-fragment-partition")
    p.add_argument("--sync-delay", type=int, default=5, help="--lsgd-fragment-sync-delay (tau)")
    p.add_argument("--alpha", type=float, default=0.0, help="--lsgd-fragment-update-alpha (streaming-diloco)")
    p.add_argument("--dc-lambda", type=float, default=0.5, help="--lsgd-cocodc-lambda")
    p.add_argument("--gamma", type=float, default=0.4, help="--lsgd-cocodc-gamma")
    p.add_argument("--syncs-per-round", type=int, default=0, help="--lsgd-cocodc-syncs-per-round (0: measure)")
    p.add_argument("--run-args", action="append", default=[], metavar="LABEL=FLAGS",
                   help="extra pretrain_gpt.py flags for one run; a label that is not built in defines a new run "
                        "(its FLAGS must name --lsgd-algorithm), and LABEL@RUN=FLAGS a variant of RUN")
    p.add_argument("--extra-args", default="", help="extra pretrain_gpt.py flags for every run")
    p.add_argument("--eval-interval", type=int, default=0, help="validate every N iterations (0: at the end only)")
    p.add_argument("--target", default=None,
                   help="report the iterations each run needs to reach this run's final validation loss")
    p.add_argument("--aedit-seconds", type=float, default=5.0,
                   help="--lsgd-aedit-interval-seconds for a-edit runs (pick about H steps' worth of time)")
    p.add_argument("--edit-ema-warmup", type=int, default=3,
                   help="--lsgd-edit-ema-warmup for edit/a-edit runs with the penalty (a short run has few syncs)")
    p.add_argument("--fault", default="1:8:100",
                   help="--lsgd-edit-inject-fault for the edit-fault and edit-nopenalty-fault runs")
    return p


def main(argv: Optional[List[str]] = None) -> None:
    p = parser()
    args = p.parse_args(argv)

    data, label = data_argv(args.data_path, args.tokenizer_model)
    world = args.sites * args.ranks_per_site
    base = base_argv(num_layers=args.num_layers, hidden_size=args.hidden_size, seq_length=args.seq_length,
                     global_batch_size=args.global_batch_size, train_iters=args.train_iters, lr=args.lr,
                     eval_interval=args.eval_interval, eval_iters=args.eval_iters, sites=args.sites, data=data,
                     extra=shlex.split(args.extra_args))
    configs = quality_runs(args)  # every algorithm's default run and named variants (recipes.py)
    for item in args.run_args:
        label, _, flags = item.partition("=")
        extra = shlex.split(flags)
        label, _, base_run = label.partition("@")  # NEW@BASE: a variant of another run (later flags win)
        if base_run and base_run not in configs:
            p.error(f"--run-args {item!r}: {base_run!r} is not a run defined before it")
        base_flags = configs[base_run] if base_run else configs.get(label, [])
        if not base_flags and "--lsgd-algorithm" not in extra:
            p.error(f"--run-args {item!r}: {label!r} is not a built-in run, so its flags must name --lsgd-algorithm "
                    f"(or write LABEL@RUN=FLAGS for a variant of RUN)")
        configs[label] = base_flags + extra
    for name in args.runs.split(","):
        if name not in configs:
            p.error(f"--runs: {name!r} is neither built in ({', '.join(configs)}) nor defined by --run-args")
    if args.target is not None and args.target not in args.runs.split(","):
        p.error(f"--target {args.target!r} is not among --runs")
    for name in args.runs.split(","):  # the training's own checks, before hours of runs, not in the middle
        try:
            build_config(parse_args(base + configs[name]), world)
        except ValueError as err:
            p.error(f"--runs: {name!r} would not start: {err}")
    budget = ["--train-samples", str(args.train_iters * args.global_batch_size)]
    os.makedirs(args.out_dir, exist_ok=True)
    results = {}
    for name in args.runs.split(","):
        print(f"> {name}", flush=True)
        argv = base + configs[name]
        if not lockstep(argv):  # sites take different numbers of steps: the same budget, in samples
            i = argv.index("--train-iters")
            argv = argv[:i] + budget + argv[i + 2:]
        results[name] = run(argv, world)
        every = args.eval_interval or args.train_iters
        results[name]["valid_iters"] = [every * (i + 1) for i in range(len(results[name]["valid"]))]
        results[name]["flags"] = configs[name]
    raw = os.path.join(results_path(args.out_dir), "lsgd_quality.json")  # measured data: under results/
    os.makedirs(os.path.dirname(os.path.abspath(raw)), exist_ok=True)
    write_json(raw, {"label": label, "argv": base, "results": results}, indent=1)

    ref = results.get("sync")
    lines = [f"Data: {label}{passes_note(args.data_path, args.train_iters * args.global_batch_size, args.seq_length)}"
             f". {args.sites} sites x {args.ranks_per_site} rank(s), {args.train_iters} iterations "
             f"x {args.global_batch_size} x {args.seq_length} tokens, H = {args.interval}, outer lr {args.outer_lr}, "
             f"outer momentum {args.outer_momentum} (diloco, edit) / {args.dilocox_outer_momentum} (dilocox); "
             f"a-edit every {args.aedit_seconds:g} s"
             + (f"; every run: {args.extra_args}" if args.extra_args else "") + ".", "",
             "| algorithm | final validation loss | vs sync | inter-site MB sent (logging rank) | "
             "sync bytes / bytes | exposed comm (s) | tokens/s |",
             "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        loss = r["valid"][-1]
        gap = f"{100 * (loss / ref['valid'][-1] - 1):+.2f}%" if ref else "-"
        sent = r["comm"].get("bytes_sent", 0)
        ratio = f"{ref['comm']['bytes_sent'] / sent:.3g}x" if ref and sent else "-"
        tps = f"{r['tokens_per_s']:.0f}" + (" (logging site)" if not lockstep(r["flags"]) else "")
        lines.append(f"| {name} | {loss:.4f} | {gap} | {sent / 2**20:.3f} | {ratio} | "
                     f"{r['comm'].get('exposed_seconds', 0):.2f} | {tps} |")
    target = None
    if args.target is not None:
        target = results[args.target]["valid"][-1]
        ref_steps = steps_to_reach(results[args.target]["valid_iters"], results[args.target]["valid"], target)
        lines += ["", f"Iterations to reach {args.target}'s final validation loss {target:.4f} (validation every "
                      f"{args.eval_interval or args.train_iters} iterations, linear interpolation):", "",
                  f"| algorithm | iterations | vs {args.target} |", "|---|---|---|"]
        for name, r in results.items():
            steps = steps_to_reach(r["valid_iters"], r["valid"], target)
            change = f"{100 * (steps / ref_steps - 1):+.1f}%" if steps is not None and ref_steps else "-"
            lines.append(f"| {name} | {steps:.0f} | {change} |" if steps is not None else
                         f"| {name} | not reached | - |")
    lines += ["", "Flags per run: " + "; ".join(f"{n}: `{' '.join(results[n]['flags'])}`" for n in results)]
    table = "\n".join(lines)
    write_text(os.path.join(args.out_dir, "lsgd_quality.md"), table + "\n")
    print(table)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG written")
        return
    curves = any(len(r["valid"]) > 1 for r in results.values())
    fig, axes = plt.subplots(1, 2 if curves else 1, figsize=(12 if curves else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    for name, r in results.items():
        xs = [10 * (i + 1) for i in range(len(r["train"]))]
        ax.plot(xs, r["train"], label=f"{name} (valid {r['valid'][-1]:.3f})")
    ax.set_xlabel("iteration (equal tokens per iteration)")
    ax.set_ylabel("training loss (mean over sites)")
    ax.set_title(f"{args.sites} sites, H={args.interval}: {label}", fontsize=9)
    ax.legend(fontsize=8)
    if curves:
        ax = axes[0][1]
        for name, r in results.items():
            ax.plot(r["valid_iters"], r["valid"], marker=".", label=name)
        if target is not None:
            ax.axhline(target, color="grey", linestyle=":", linewidth=1,
                       label=f"{args.target}'s final validation loss")
        ax.set_xlabel("iteration")
        ax.set_ylabel("validation loss (mean over sites' models)")
        ax.set_title("validation loss", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, os.path.join(args.out_dir, "lsgd_quality.png"), dpi=120)
    print(f"wrote {args.out_dir}/lsgd_quality.{{md,png}} and {raw}")


if __name__ == "__main__":
    run_tool(main, "no table written")  # (nothing is written until every run has finished)
