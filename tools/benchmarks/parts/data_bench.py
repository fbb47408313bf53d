#!/usr/bin/env python
"""Data-pipeline benchmark; prints a Markdown table.

    python -m tools.bench parts data          # all measurements (about a minute on 2 cores)
    python -m tools.bench parts data --quick  # smaller index sizes

Measures preprocessing throughput (MB of JSON text per second) with 1 and 2 workers on the
bundled python-docs slice, and the time to build the sample index for --tokens tokens and
the blending index with the C++ extension vs the pure-Python reference.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from typing import Callable, List, Tuple

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tools/
import _bootstrap  # noqa: E402,F401
import preprocess_data  # noqa: E402
from megatron_lsgd.core.datasets import helpers  # noqa: E402

CORPUS = os.path.join(_bootstrap.REPO_ROOT, "data", "python-docs")


def timed(fn: Callable, repeat: int = 1) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bench_preprocess(workers: int, out_dir: str) -> Tuple[float, float, int]:
    argv = ["--input", os.path.join(CORPUS, "python-docs-3.11-slice.jsonl.gz"),
            "--output-prefix", os.path.join(out_dir, f"w{workers}"),
            "--tokenizer-type", "SentencePieceTokenizer",
            "--tokenizer-model", os.path.join(CORPUS, "python_docs_sp8k.model"),
            "--append-eod", "--workers", str(workers), "--log-interval", "0"]
    start = time.perf_counter()
    stats = preprocess_data.run(preprocess_data.build_parser().parse_args(argv))
    elapsed = time.perf_counter() - start
    return stats.text_bytes / elapsed / 1e6, elapsed, stats.tokens


def synthetic_corpus(tokens: int, mean_doc: int, epochs: int, seed: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    n_docs = max(1, tokens // (mean_doc * epochs))
    sizes = rng.geometric(1.0 / mean_doc, size=n_docs).astype(np.int32)
    doc_idx = np.concatenate([rng.permutation(n_docs) for _ in range(epochs)]).astype(np.int64)
    return sizes, doc_idx


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=float, default=1e8, help="tokens covered by the sample index")
    p.add_argument("--mean-doc-length", type=int, default=500)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--blend-samples", type=int, default=2_000_000)
    p.add_argument("--quick", action="store_true", help="1e7 tokens and 2e5 blend samples")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.blend_samples = 1e7, 200_000

    rows: List[Tuple[str, str]] = []
    with tempfile.TemporaryDirectory() as out_dir:
        for workers in (1, 2):
            mbps, elapsed, tokens = bench_preprocess(workers, out_dir)
            rows.append((f"preprocess_data.py, python-docs slice (5.0 MB), {workers} worker(s)",
                         f"{mbps:.2f} MB/s ({elapsed:.2f} s, {tokens / elapsed / 1e3:.0f} k tokens/s)"))

    sizes, doc_idx = synthetic_corpus(int(args.tokens), args.mean_doc_length, epochs=1)
    total = int(sizes.astype(np.int64).sum())
    num_samples = (total - 1) // args.seq_length
    ref = helpers.build_sample_idx_py(sizes, doc_idx, args.seq_length, num_samples)
    t_py = timed(lambda: helpers.build_sample_idx_py(sizes, doc_idx, args.seq_length, num_samples))
    t_cpp = timed(lambda: helpers.build_sample_idx(sizes, doc_idx, args.seq_length, num_samples), repeat=3)
    assert np.array_equal(ref, helpers.build_sample_idx(sizes, doc_idx, args.seq_length, num_samples))
    label = (f"sample index, {total / 1e6:.0f} M tokens, {sizes.size} docs (mean {args.mean_doc_length}), "
             f"seq {args.seq_length}, {num_samples} samples")
    rows.append((label + ", C++", f"{t_cpp * 1e3:.1f} ms"))
    rows.append((label + ", Python", f"{t_py * 1e3:.0f} ms"))
    rows.append(("sample index speed-up C++ / Python", f"{t_py / t_cpp:.0f}x"))

    weights = np.array([0.4, 0.3, 0.2, 0.1])
    t_bpy = timed(lambda: helpers.build_blending_indices_py(weights, args.blend_samples))
    t_bcpp = timed(lambda: helpers.build_blending_indices(weights, args.blend_samples), repeat=3)
    rows.append((f"blending index, 4 datasets, {args.blend_samples} samples, C++", f"{t_bcpp * 1e3:.1f} ms"))
    rows.append((f"blending index, 4 datasets, {args.blend_samples} samples, Python", f"{t_bpy * 1e3:.0f} ms"))
    rows.append(("blending index speed-up C++ / Python", f"{t_bpy / t_bcpp:.0f}x"))

    print(f"Data pipeline benchmark, {time.strftime('%Y-%m-%d')}, {platform.machine()} "
          f"{os.cpu_count()}-core CPU, Python {platform.python_version()}\n")
    print("| measurement | result |")
    print("|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
