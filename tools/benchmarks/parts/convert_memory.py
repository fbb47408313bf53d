#!/usr/bin/env python
"""Peak host memory of tools/checkpoint/convert.py against model size; prints a Markdown table.

    python -m tools.bench parts convert                  # 12 and 120 layers (5.5 GB on disk at most)
    python -m tools.bench parts convert --quick          # 4 and 40 layers of a smaller model
    python -m tools.bench parts convert --root /tmp/old  # also the convert.py of another checkout

For each size it trains one iteration of a Llama-style model (many layers, each tensor
small) on one process and saves it with its AdamW state (model + 2 moments), then runs
each conversion as a child process and reads its peak resident set (`ru_maxrss` from
`os.wait4`, file-backed pages of memory-mapped sources included):

    reshard   lsgd TP1 x PP1 -> TP2 x PP4, optimizer state included (rank files -> by parameter)
    reshard2  that TP2 x PP4 checkpoint -> TP1 x PP6, optimizer state included (by parameter)
    to-hf     lsgd -> Hugging Face, safetensors shards of --max-shard-size (site 0's weights)
    from-hf   that Hugging Face export -> lsgd TP2 x PP4 (weights)

`--root DIR` (repeatable) runs the convert.py of another source tree on the same sources,
e.g. an older commit extracted with `git archive <commit> | tar -x -C DIR`, for an old-vs-new
table. "import" is the peak of a child that only imports torch and the converter's modules.
Everything is written under a temporary directory (or --work), removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

LLAMA = ["--group-query-attention", "--num-query-groups", "2", "--normalization", "RMSNorm",
         "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights"]


def child_peak(cmd: List[str], env: Dict[str, str], cwd: str) -> Tuple[int, float, str]:
    """(peak RSS in bytes, seconds, output) of one child process."""
    start = time.perf_counter()
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read().decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{text[-3000:]}")
    kib = usage.ru_maxrss  # Linux: KiB
    return kib * 1024, time.perf_counter() - start, text


def env_for(root: str) -> Dict[str, str]:
    return dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1")


def dir_bytes(path: str) -> Tuple[int, int]:
    """(total bytes, largest file) under path."""
    total = largest = 0
    for base, _, files in os.walk(path):
        for f in files:
            n = os.path.getsize(os.path.join(base, f))
            total += n
            largest = max(largest, n)
    return total, largest


def build_source(path: str, layers: int, hidden: int) -> int:
    """Train one iteration and save (TP1 x PP1, AdamW); returns the parameter count."""
    argv = [sys.executable, "pretrain_gpt.py", "--num-layers", str(layers), "--hidden-size", str(hidden),
            "--num-attention-heads", "4", "--ffn-hidden-size", str(4 * hidden), "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "1",
            "--train-iters", "1", "--lr", "1e-4", "--mock-data", "--vocab-size", "250",
            "--make-vocab-size-divisible-by", "8", "--eval-iters", "0", "--log-interval", "1",
            "--distributed-backend", "gloo", "--seed", "1", "--save", path] + LLAMA
    env = dict(env_for(REPO))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    child_peak(argv, env, REPO)
    meta_dir = os.path.join(path, "iter_0000001")
    with open(os.path.join(meta_dir, "metadata.json")) as f:
        config = json.load(f)["model_config"]
    h, f_, v, n = config["hidden_size"], config["ffn_hidden_size"], config["padded_vocab_size"], config["num_layers"]
    kv = config["kv_channels"] * config["num_query_groups"]
    per_layer = h * (h + 2 * kv) + h * h + 2 * f_ * h + f_ * h + 2 * h
    return n * per_layer + 2 * v * h + h


def convert_cmd(root: str, loader: str, saver: str, src: str, dst: str, extra: List[str]) -> List[str]:
    return [sys.executable, os.path.join(root, "tools", "checkpoint", "convert.py"), "--model-type", "GPT",
            "--loader", loader, "--saver", saver, "--load-dir", src, "--save-dir", dst] + extra


def supports_shards(root: str) -> bool:
    with open(os.path.join(root, "tools", "checkpoint", "saver_hf.py")) as f:
        return "max-shard-size" in f.read()


CASES = [  # name, loader, saver, source (a key of `made`), target flags
    ("reshard", "lsgd", "lsgd", "src", ["--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "4"]),
    ("reshard2", "lsgd", "lsgd", "reshard", ["--target-tensor-parallel-size", "1",
                                             "--target-pipeline-parallel-size", "6"]),
    ("to-hf", "lsgd", "hf", "src", []),
    ("from-hf", "hf", "lsgd", "to-hf", ["--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "4"]),
]


def run(sizes: List[int], hidden: int, roots: List[str], shard: str, work: str) -> List[Dict]:
    rows = []
    import_peak = {root: child_peak([sys.executable, "-c", "import torch, safetensors, megatron_lsgd.training."
                                     "checkpointing.full_model, megatron_lsgd.training.checkpointing.hf_mapping"],
                                    env_for(root), root)[0] for root in roots}
    for layers in sizes:
        base = os.path.join(work, f"L{layers}")
        os.makedirs(base)
        made = {"src": os.path.join(base, "src")}
        params = build_source(made["src"], layers, hidden)
        src_bytes = dir_bytes(made["src"])[0]
        for name, loader, saver, source, flags in CASES:
            for i, root in enumerate(roots):
                dst = os.path.join(base, f"{name}.{i}")
                extra = list(flags)
                if saver == "hf" and supports_shards(root):
                    extra += ["--max-shard-size", shard]
                peak, seconds, _ = child_peak(convert_cmd(root, loader, saver, made[source], dst, extra),
                                              env_for(root), root)
                total, largest = dir_bytes(dst)
                rows.append({"layers": layers, "params": params, "source_bytes": src_bytes, "case": name,
                             "root": root, "peak": peak, "import": import_peak[root], "seconds": seconds,
                             "target_bytes": total, "largest_file": largest,
                             "source_of_case": dir_bytes(made[source])[0]})
                if i == 0:
                    made[name] = dst
                else:
                    shutil.rmtree(dst)
            print(f"  L{layers} {name}: " + ", ".join(f"{r['peak'] / 2**20:.0f} MiB" for r in rows[-len(roots):]),
                  file=sys.stderr, flush=True)
        shutil.rmtree(base)
    return rows


def table(rows: List[Dict], roots: List[str]) -> str:
    mib = 2 ** 20
    head = ["layers", "params", "case", "source MiB", "largest target file MiB"]
    head += [f"peak RSS MiB ({'this tree' if i == 0 else os.path.basename(r.rstrip('/')) or r})"
             for i, r in enumerate(roots)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by_key: Dict[Tuple, Dict[str, Dict]] = {}
    for r in rows:
        by_key.setdefault((r["layers"], r["case"]), {})[r["root"]] = r
    for (layers, case), per_root in by_key.items():
        first = per_root[roots[0]]
        cells = [str(layers), f"{first['params'] / 1e6:.1f} M", case, f"{first['source_of_case'] / mib:.0f}",
                 f"{first['largest_file'] / mib:.0f}"]
        cells += [f"{per_root[r]['peak'] / mib:.0f} ({per_root[r]['seconds']:.0f} s)" for r in roots]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    imports = {r["root"]: r["import"] for r in rows}
    lines.append("import only (torch + the converter's modules), per column: "
                 + ", ".join(f"{imports[r] / mib:.0f} MiB" for r in roots))
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", default="12,120", help="model sizes, in layers (comma-separated; divisible by 12)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--quick", action="store_true", help="--layers 12,48 --hidden 128")
    p.add_argument("--max-shard-size", default="50MB", help="for the Hugging Face export")
    p.add_argument("--root", action="append", default=[], help="another source tree's convert.py to measure too")
    p.add_argument("--work", help="directory for the checkpoints (default: a temporary one, removed)")
    args = p.parse_args(argv)
    sizes = [12, 48] if args.quick else [int(x) for x in args.layers.split(",")]
    hidden = 128 if args.quick else args.hidden
    roots = [REPO] + [os.path.abspath(r) for r in args.root]
    work = tempfile.mkdtemp(prefix="convert_memory.", dir=args.work)
    try:
        rows = run(sizes, hidden, roots, args.max_shard_size, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"convert.py peak RSS, {time.strftime('%Y-%m-%d')}, {platform.machine()} {os.cpu_count()}-core "
          f"{platform.system()}, python {platform.python_version()}")
    print(table(rows, roots))
    return 0


if __name__ == "__main__":
    sys.exit(main())
