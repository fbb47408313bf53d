"""Quality at equal tokens: sync vs diloco vs dilocox vs acco vs dpu vs dreamddp across two sites (CPU/gloo or GPU).

Runs each algorithm in `--sites` x `--ranks-per-site` spawned processes on the same data,
model, seed and token budget, and writes a Markdown table (final validation loss and its
gap to sync, inter-site bytes actually sent by the rank that logs, ratio to sync, exposed
communication, tokens/s) plus a PNG of training and validation loss curves.

    python tools/benchmarks/lsgd_quality.py --data-path data/python-docs/..._text_document \\
        --tokenizer-model data/python-docs/tokenizer.model --out-dir docs/algorithms/results

Without --data-path (or if it does not exist) it runs on --mock-data and says so in
every output. `--extra-args` adds flags to every run, e.g. a simulated slow link
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
from typing import Dict, List

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from megatron_lsgd.training.initialize import free_port  # noqa: E402


def _worker(rank: int, world: int, port: int, argv: List[str], out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import pretrain_gpt
    from megatron_lsgd.training.initialize import shutdown_distributed

    t0 = time.perf_counter()
    result = pretrain_gpt.main(argv)
    if rank == world - 1:  # the logging rank
        with open(out, "w") as f:
            json.dump({"train": result.logged_losses, "valid": result.validation_losses,
                       "comm": result.comm, "stats": result.sync_stats, "tokens_per_s": result.tokens_per_second,
                       "seconds": time.perf_counter() - t0}, f)
    shutdown_distributed()


def run(argv: List[str], world: int) -> Dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        mp.spawn(_worker, args=(world, free_port(), argv, out), nprocs=world, join=True)
        with open(out) as f:
            return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-path", default=None)
    p.add_argument("--tokenizer-model", default=None)
    p.add_argument("--out-dir", default="docs/algorithms/results")
    p.add_argument("--sites", type=int, default=2)
    p.add_argument("--ranks-per-site", type=int, default=1)
    p.add_argument("--train-iters", type=int, default=600)
    p.add_argument("--interval", type=int, default=50, help="H for diloco, dilocox and dreamddp")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-iters", type=int, default=10)
    p.add_argument("--runs", default="sync,diloco,dilocox-int4,dilocox-lowrank-int4,acco,dpu,dreamddp")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--dilocox-outer-momentum", type=float, default=0.5,
                   help="outer momentum for dilocox runs (a one-round-late Δ̄ with 0.9 oscillated in our runs)")
    p.add_argument("--restart", choices=["eager", "anchor"], default="eager", help="--lsgd-dilocox-restart")
    p.add_argument("--rank", type=int, default=8, help="--lsgd-rank for dilocox-lowrank-int4")
    p.add_argument("--apply-step", type=int, default=0,
                   help="--lsgd-dilocox-apply-step for dilocox runs (0: H, the one-round delay)")
    p.add_argument("--extra-args", default="", help="extra pretrain_gpt.py flags for every run")
    args = p.parse_args()

    real = bool(args.data_path) and os.path.exists(args.data_path + ".bin")
    if real:
        data = ["--data-path", args.data_path, "--tokenizer-type", "SentencePieceTokenizer",
                "--tokenizer-model", args.tokenizer_model, "--split", "98,2,0"]
    else:
        data = ["--mock-data", "--vocab-size", "512"]
    label = f"real corpus {args.data_path}" if real else "MOCK DATA (synthetic tokens; not the real corpus)"
    world = args.sites * args.ranks_per_site
    base = ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", "4", "--seq-length", str(args.seq_length), "--micro-batch-size", "4",
            "--global-batch-size", str(args.global_batch_size), "--train-iters", str(args.train_iters),
            "--lr", str(args.lr), "--min-lr", str(args.lr / 10), "--lr-decay-style", "cosine",
            "--lr-warmup-iters", str(args.train_iters // 20), "--weight-decay", "0.1", "--clip-grad", "1.0",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "10",
            "--eval-interval", str(args.train_iters), "--eval-iters", str(args.eval_iters), "--seed", "1234",
            "--num-sites", str(args.sites), "--normalization", "RMSNorm", "--position-embedding-type", "rope",
            "--swiglu", "--disable-bias-linear"] + data + shlex.split(args.extra_args)
    outer = ["--lsgd-interval", str(args.interval), "--lsgd-outer-lr", str(args.outer_lr),
             "--lsgd-outer-momentum", str(args.outer_momentum)]
    outer_x = ["--lsgd-interval", str(args.interval), "--lsgd-outer-lr", str(args.outer_lr),
               "--lsgd-outer-momentum", str(args.dilocox_outer_momentum), "--lsgd-dilocox-restart", args.restart,
               "--lsgd-dilocox-apply-step", str(args.apply_step)]
    configs = {
        "sync": ["--lsgd-algorithm", "sync"],
        "diloco": ["--lsgd-algorithm", "diloco"] + outer,
        "dilocox-none": ["--lsgd-algorithm", "dilocox"] + outer_x,
        "dilocox-int4": ["--lsgd-algorithm", "dilocox", "--lsgd-compression", "int4"] + outer_x,
        "dilocox-lowrank-int4": ["--lsgd-algorithm", "dilocox", "--lsgd-compression", "lowrank-int4",
                                 "--lsgd-rank", str(args.rank)] + outer_x,
        # Equal tokens: the configured micro-batches every step (adaptive accumulation would add
        # some whenever the overlapped reduce + step outlast a stage's compute).
        "acco": ["--lsgd-algorithm", "acco", "--lsgd-accumulation", "fixed"],
        "dpu": ["--lsgd-algorithm", "dpu", "--lsgd-accumulation", "fixed"],
        # dreamddp averages parameters (no outer optimizer): compare it with diloco at outer lr 1,
        # momentum 0, which averages the whole model every H steps
        "dreamddp": ["--lsgd-algorithm", "dreamddp", "--lsgd-interval", str(args.interval)],
        "dreamddp-nofill": ["--lsgd-algorithm", "dreamddp", "--lsgd-interval", str(args.interval),
                            "--lsgd-dreamddp-no-bubble-fill"],
        "dreamddp-enp": ["--lsgd-algorithm", "dreamddp", "--lsgd-interval", str(args.interval),
                         "--lsgd-dreamddp-scheduler", "equal", "--lsgd-dreamddp-no-bubble-fill"],
    }
    unknown = [n for n in args.runs.split(",") if n not in configs]
    if unknown:
        p.error(f"--runs: unknown {', '.join(unknown)} (have: {', '.join(configs)})")
    os.makedirs(args.out_dir, exist_ok=True)
    results = {}
    for name in args.runs.split(","):
        print(f"> {name}", flush=True)
        results[name] = run(base + configs[name], world)
    with open(os.path.join(args.out_dir, "lsgd_quality.json"), "w") as f:
        json.dump({"label": label, "argv": base, "results": results}, f, indent=1)

    ref = results.get("sync")
    lines = [f"Data: {label}. {args.sites} sites x {args.ranks_per_site} rank(s), {args.train_iters} iterations "
             f"x {args.global_batch_size} x {args.seq_length} tokens, H = {args.interval}, outer lr {args.outer_lr}, "
             f"outer momentum {args.outer_momentum} (diloco) / {args.dilocox_outer_momentum} (dilocox)"
             + (f"; every run: {args.extra_args}" if args.extra_args else "") + ".", "",
             "| algorithm | final validation loss | vs sync | inter-site MB sent (logging rank) | "
             "sync bytes / bytes | exposed comm (s) | tokens/s |",
             "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        loss = r["valid"][-1]
        gap = f"{100 * (loss / ref['valid'][-1] - 1):+.2f}%" if ref else "-"
        sent = r["comm"].get("bytes_sent", 0)
        ratio = f"{ref['comm']['bytes_sent'] / sent:.3g}x" if ref and sent else "-"
        lines.append(f"| {name} | {loss:.4f} | {gap} | {sent / 2**20:.3f} | {ratio} | "
                     f"{r['comm'].get('exposed_seconds', 0):.2f} | {r['tokens_per_s']:.0f} |")
    table = "\n".join(lines)
    with open(os.path.join(args.out_dir, "lsgd_quality.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG written")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in results.items():
        xs = [10 * (i + 1) for i in range(len(r["train"]))]
        ax.plot(xs, r["train"], label=f"{name} (valid {r['valid'][-1]:.3f})")
    ax.set_xlabel("iteration (equal tokens per iteration)")
    ax.set_ylabel("training loss (mean over sites)")
    ax.set_title(f"{args.sites} sites, H={args.interval}: {label}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out_dir, "lsgd_quality.png"), dpi=120)
    print(f"wrote {args.out_dir}/lsgd_quality.{{md,json,png}}")


if __name__ == "__main__":
    main()
