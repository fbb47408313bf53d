"""Side-by-side benchmark of cross-site algorithms over an emulated WAN, with the ceiling.

    python -m tools.bench wan                                 # default scenario
    python -m tools.bench wan --slow-ranks 1 --slow-factor 2  # one 2x straggler
    python -m tools.bench wan --algorithms sync,diloco --algo-args "diloco=--lsgd-interval 10"
    python -m tools.bench wan --algorithms diloco,dilocox,dilocox-int4=dilocox \\
        --algo-args "dilocox-int4=--lsgd-compression int4"            # two runs of one algorithm

In one invocation, on one set of namespaces (tools/wan): first the ceiling (every site
trains alone, at the same time, with the same per-site batch and --num-sites 1, so no
byte crosses sites), then each algorithm on all sites. Every run trains the same model for
--train-iters updates of the configured global batch (algorithms whose sites take different
numbers of steps, A-EDiT, get that token budget as `--train-samples` and stop when it is
used; acco/dpu's adaptive accumulation adds micro-batches to its updates, so it trains on
more tokens). The table's headline is progress: updates/s against the ceiling, and the
wall-clock time to sync's final loss; tokens/s (work done) stands beside them. Writes
results.md and updates_per_s.png, tokens_per_s.png, loss_vs_wall.png, loss_vs_tokens.png to
--out-dir, and results.json plus each run's logs (`wan_report.py OUT_DIR` re-reports them) to
--out-dir too, or, for an --out-dir in docs/, to the same path under results/ (measured data is
kept outside docs/: docs/benchmarks/default's is in results/benchmarks/default).

Default scenario: 2 sites x 1 rank, 100 Mbit/s, 20 ms one-way, a 7.2M-parameter Llama
(4 layers, hidden 256, GQA, SwiGLU, RMSNorm, RoPE) on the bundled Python-docs corpus.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys
from typing import Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

from megatron_lsgd.core.lsgd.catalog import registered_algorithms, synchronizer_class  # noqa: E402
from tools.benchmarks.wan import wan_report  # noqa: E402
from tools.benchmarks.run_cache import results_path  # noqa: E402
from tools.benchmarks.tool_input import tool_errors  # noqa: E402
from tools.wan.launch import SiteJob, add_link_args, raise_on_termination, run_jobs, topology_from_args, \
    torchrun_cmd  # noqa: E402
from tools.wan.netns import WanError  # noqa: E402

DATA = "data/python-docs"
MODEL_ARGS = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
              "--group-query-attention", "--num-query-groups", "2", "--normalization", "RMSNorm",
              "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
              "--untie-embeddings-and-output-weights", "--hidden-dropout", "0", "--attention-dropout", "0"]
DATA_ARGS = ["--data-path", f"{DATA}/python_docs_text_document", "--split", "949,50,1",
             "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", f"{DATA}/python_docs_sp8k.model"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_link_args(p)
    p.add_argument("--algorithms", default=",".join(registered_algorithms()),
                   help="comma-separated runs: an --lsgd-algorithm value, or LABEL=ALGORITHM to run one algorithm "
                        "more than once under different --algo-args (default: every registered algorithm once)")
    p.add_argument("--algo-args", action="append", default=[], metavar="LABEL=FLAGS",
                   help="extra pretrain_gpt.py flags for one run, e.g. 'diloco=--lsgd-interval 10'")
    p.add_argument("--extra-args", default="", help="extra pretrain_gpt.py flags for every run (ceiling too)")
    p.add_argument("--ranks-per-site", type=int, default=1)
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size inside a site")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size inside a site")
    p.add_argument("--micro-batch-size", type=int, default=4,
                   help="sequences per micro-batch (the default 4 gives two micro-batches per site-batch of 8: "
                        "acco needs at least two per step, one per stage)")
    p.add_argument("--site-batch-size", type=int, default=8, help="sequences per step per site")
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--train-iters", type=int, default=40,
                   help="length of every run: updates of the configured global batch (a non-lockstep run, "
                        "a-edit, gets the same tokens as --train-samples)")
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument("--warmup-intervals", type=int, default=1, help="log intervals left out of updates/s and tokens/s")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--slow-ranks", default="", help="global ranks made slower (--simulate-slow-ranks)")
    p.add_argument("--slow-factor", type=float, default=2.0)
    p.add_argument("--slow-mode", choices=["consistent", "random"], default="consistent")
    p.add_argument("--out-dir", default=None, help="default: runs/wan_bench/<date-time> (one in docs/ keeps its "
                                                   "results.json and logs under results/, same path)")
    p.add_argument("--timeout-per-run", type=float, default=1800.0)
    a = p.parse_args(argv)
    runs: Dict[str, str] = {}  # label -> algorithm, in order
    for item in (x for x in a.algorithms.split(",") if x):
        label, _, algo = item.partition("=")
        algo = algo or label
        if algo not in registered_algorithms():
            p.error(f"--algorithms: {algo!r} is not registered (have: {', '.join(registered_algorithms())})")
        if label in runs or label == wan_report.CEILING:
            p.error(f"--algorithms: the label {label!r} is used twice (or is reserved)")
        runs[label] = algo
    if not runs:
        p.error("--algorithms: name at least one run")
    a.algorithms = list(runs)
    a.run_algorithm = runs
    per_algo: Dict[str, List[str]] = {}
    for item in a.algo_args:
        name, _, flags = item.partition("=")
        if name not in runs:
            p.error(f"--algo-args {item!r}: {name!r} is not among --algorithms")
        per_algo[name] = shlex.split(flags)
    a.per_algo = per_algo
    if a.site_batch_size % (a.micro_batch_size * (a.ranks_per_site // (a.tp * a.pp) or 1)):
        p.error("--site-batch-size must be a multiple of --micro-batch-size x data-parallel ranks per site")
    a.out_dir = os.path.abspath(a.out_dir or os.path.join(REPO, "runs", "wan_bench",
                                                       datetime.datetime.now().strftime("%Y%m%d-%H%M%S")))
    return a


def common_args(a: argparse.Namespace, num_sites: int, json_log: str, slow_ranks: List[int],
                lockstep: bool = True) -> List[str]:
    """pretrain_gpt.py's flags for one run. The budget is the same for every run: --train-iters
    global batches, given as --train-samples to algorithms whose sites take different numbers
    of steps (the others keep --train-iters, which some of them, e.g. acco's adaptive
    accumulation, need)."""
    gbs = a.site_batch_size * num_sites
    budget = ["--train-iters", str(a.train_iters)] if lockstep else ["--train-samples", str(a.train_iters * gbs)]
    args = ["pretrain_gpt.py", *MODEL_ARGS, *DATA_ARGS, "--seq-length", str(a.seq_length),
            "--micro-batch-size", str(a.micro_batch_size), "--global-batch-size", str(gbs),
            *budget, "--lr", str(a.lr), "--min-lr", str(a.lr / 10),
            "--lr-decay-style", "cosine", "--lr-warmup-iters", str(max(1, a.train_iters // 10)),
            "--weight-decay", "0.1", "--adam-beta2", "0.95", "--clip-grad", "1.0",
            "--tensor-model-parallel-size", str(a.tp), "--pipeline-model-parallel-size", str(a.pp),
            "--num-sites", str(num_sites), "--use-distributed-optimizer",
            "--log-interval", str(a.log_interval), "--eval-iters", "0", "--json-log", json_log,
            *shlex.split(a.extra_args)]
    if slow_ranks:
        args += ["--simulate-slow-ranks", ",".join(map(str, slow_ranks)), "--slow-factor", str(a.slow_factor),
                 "--slow-mode", a.slow_mode]
    return args


def scenario(a: argparse.Namespace, backend: str) -> dict:
    straggler = None
    if a.slow_ranks:
        straggler = {"ranks": a.slow_ranks, "factor": a.slow_factor, "mode": a.slow_mode}
    return {"sites": a.sites, "ranks_per_site": a.ranks_per_site, "tp": a.tp, "pp": a.pp,
            "rate_mbit": a.rate_mbit, "delay_ms": a.delay_ms, "jitter_ms": a.jitter_ms, "loss_pct": a.loss_pct,
            "link_backend": backend, "straggler": straggler,
            "model": "Llama-style, 4 layers, hidden 256, 4 heads (2 KV groups), SwiGLU, RMSNorm, RoPE, untied, "
                     "vocab 8k (7.2M parameters)",
            "seq_length": a.seq_length, "site_batch_size": a.site_batch_size, "micro_batch_size": a.micro_batch_size,
            "train_iters": a.train_iters, "algorithm_args": {k: " ".join(v) for k, v in a.per_algo.items()},
            "runs": {label: algo for label, algo in a.run_algorithm.items()},
            "extra_args": a.extra_args, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": f"{platform.node()}, {os.cpu_count()} CPUs, {platform.machine()}, torch {torch.__version__}",
            "command": " ".join(shlex.quote(x) for x in sys.argv)}


def main(argv=None) -> int:
    a = parse_args(argv)
    try:  # the .bin/.idx dataset needs the C++ index helpers; fail now rather than in every rank
        from megatron_lsgd import _C  # noqa: F401
    except ImportError:
        print("error: megatron_lsgd._C is not built; run `pip install -e .` (or `python setup.py build_ext "
              "--inplace`) in the repository root", file=sys.stderr)
        return 2
    try:
        slow = [int(r) for r in a.slow_ranks.split(",") if r.strip()]
    except ValueError:
        print(f"error: --slow-ranks {a.slow_ranks!r}: give comma-separated rank numbers", file=sys.stderr)
        return 2
    world_per_site = a.ranks_per_site
    logs = os.path.join(results_path(a.out_dir), "logs")  # measured data: never into docs/
    raise_on_termination()
    summaries: Dict[str, dict] = {}
    try:
        with topology_from_args(a) as wan:
            print(f"wan: backend {wan.backend}; output in {a.out_dir}", flush=True)
            # Ceiling: every site alone, all at once (they share the machine as in the real runs).
            jobs, site_logs = [], []
            for i in range(a.sites):
                local_slow = [r - i * world_per_site for r in slow if i * world_per_site <= r < (i + 1) * world_per_site]
                site_logs.append(os.path.join(logs, f"{wan_report.CEILING}.site{i}.jsonl"))
                jobs.append(SiteJob(i, torchrun_cmd(1, 0, world_per_site, wan.site_ip(i), 29500,
                                                    common_args(a, 1, site_logs[-1], local_slow)),
                                    os.path.join(logs, f"{wan_report.CEILING}.site{i}.log")))
            _run(wan, jobs, a, wan_report.CEILING)
            ceiling = wan_report.combine_ceiling([wan_report.summarize(wan_report.read_log(p), a.warmup_intervals)
                                                  for p in site_logs])
            for n, algo in enumerate(a.algorithms):
                json_log = os.path.join(logs, f"{algo}.jsonl")
                script = common_args(a, a.sites, json_log, slow,
                                     synchronizer_class(a.run_algorithm[algo]).lockstep) \
                    + ["--lsgd-algorithm", a.run_algorithm[algo]] \
                    + a.per_algo.get(algo, [])
                jobs = [SiteJob(i, torchrun_cmd(a.sites, i, world_per_site, wan.site_ip(0), 29501 + n, script),
                                os.path.join(logs, f"{algo}.site{i}.log")) for i in range(a.sites)]
                _run(wan, jobs, a, algo)
                summaries[algo] = wan_report.summarize(wan_report.read_log(json_log), a.warmup_intervals)
            backend = wan.backend
    except (WanError, RuntimeError, TimeoutError, ValueError) as err:  # ValueError: link or topology flags
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: every site stopped, namespaces deleted", file=sys.stderr)
        return 130
    results = wan_report.build_results(scenario(a, backend), ceiling, summaries)
    paths = wan_report.write_all(results, a.out_dir)
    print(wan_report.markdown_table(results))
    print("wrote " + ", ".join(paths))
    return 0


def _run(wan, jobs, a, name: str) -> None:
    for j in jobs:  # fresh logs: --json-log appends
        jl = j.cmd[j.cmd.index("--json-log") + 1]
        if os.path.exists(jl):
            os.remove(jl)
    print(f"running {name} ...", flush=True)
    codes = run_jobs(wan, jobs, a.timeout_per_run)
    if any(codes):
        raise RuntimeError(f"{name} failed (exit codes {codes}); see {', '.join(j.log_path for j in jobs)}")


if __name__ == "__main__":
    with tool_errors():
        sys.exit(main())
