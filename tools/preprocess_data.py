#!/usr/bin/env python
"""Tokenize a JSONL corpus into Megatron .bin/.idx pairs, one per --json-keys entry.

    python tools/preprocess_data.py --input corpus.jsonl.gz --output-prefix out/corpus \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model --append-eod --workers 2

writes out/corpus_text_document.bin and out/corpus_text_document.idx. Each JSON line is one
document (one sequence). Lines that are not JSON, lack a key or hold a non-string are skipped
and counted with a `file:line` warning (--strict makes them fatal); documents that tokenize
to nothing are skipped and counted. --partitions P splits the input into P contiguous line
ranges processed in parallel (workers shared among them) and merged in order, so the output
equals the single-partition output.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

import _bootstrap  # noqa: F401
from megatron_lsgd import cli
from megatron_lsgd.core.datasets.indexed_dataset import (IndexedDatasetBuilder, data_file_path, index_file_path,
                                                         optimal_token_dtype)
from megatron_lsgd.core.datasets.jsonl import JsonlError, count_lines, iter_lines, parse_line
from megatron_lsgd.training.tokenizer import TOKENIZER_TYPES, TokenizerConfig, build_tokenizer

_MAX_WARNINGS = 10


@dataclass
class Stats:
    documents: int = 0
    empty: int = 0
    bad_lines: int = 0
    text_bytes: int = 0
    tokens: int = 0
    warnings: List[str] = field(default_factory=list)
    written: Dict[str, int] = field(default_factory=dict)  # documents written per --json-keys key

    def add(self, other: "Stats") -> None:
        self.documents += other.documents
        self.empty += other.empty
        self.bad_lines += other.bad_lines
        self.text_bytes += other.text_bytes
        self.tokens += other.tokens
        for key, n in other.written.items():
            self.written[key] = self.written.get(key, 0) + n
        self.warnings.extend(other.warnings[: max(0, _MAX_WARNINGS - len(self.warnings))])


class Encoder:
    """Per-process tokenizer state; built once per worker by the pool initializer."""

    tokenizer = None
    keys: Sequence[str] = ()
    append_eod = False
    path = ""
    dtype = np.int32

    @classmethod
    def init(cls, tok_cfg: TokenizerConfig, keys: Sequence[str], append_eod: bool, path: str) -> None:
        cls.tokenizer = build_tokenizer(tok_cfg)
        cls.keys, cls.append_eod, cls.path = keys, append_eod, path
        cls.dtype = optimal_token_dtype(cls.tokenizer.vocab_size)

    @classmethod
    def encode(cls, item: Tuple[int, str]):
        lineno, line = item
        parsed = parse_line(line, cls.keys, lineno, cls.path)
        if parsed.error:
            return lineno, None, parsed.error, 0
        docs: List[Optional[np.ndarray]] = []
        nbytes = 0
        for text in parsed.texts:
            nbytes += len(text.encode("utf-8"))
            try:
                ids = cls.tokenizer.tokenize(text)
            except ValueError as exc:  # e.g. NullTokenizer given words: a bad line, named
                return lineno, None, f"{cls.path}:{lineno}: cannot tokenize: {exc}", 0
            if not ids:
                docs.append(None)
                continue
            if cls.append_eod:
                ids.append(cls.tokenizer.eod)
            docs.append(np.asarray(ids, dtype=cls.dtype))
        return lineno, docs, None, nbytes


def output_prefix(prefix: str, key: str) -> str:
    return f"{prefix}_{key}_document"


def _progress(stats: Stats, start: float, label: str) -> None:
    elapsed = max(time.time() - start, 1e-9)
    print(f"{label}processed {stats.documents} documents ({stats.documents / elapsed:.1f} docs/s, "
          f"{stats.text_bytes / elapsed / 1e6:.2f} MB/s)", file=sys.stderr, flush=True)


def _empty_keys(args: argparse.Namespace, stats: Stats) -> List[str]:
    return [key for key in args.json_keys if not stats.written.get(key)]


def _no_documents(args: argparse.Namespace, stats: Stats) -> ValueError:
    keys = _empty_keys(args, stats)
    what = "no documents to write" if len(keys) == len(args.json_keys) else \
        f"no documents for --json-keys {' '.join(keys)}"
    return ValueError(f"{args.input}: {what} ({stats.bad_lines} bad lines and {stats.empty} empty documents "
                      f"skipped); nothing was written")


def process_range(args: argparse.Namespace, tok_cfg: TokenizerConfig, prefix: str, workers: int,
                  start_line: int = 0, stop_line: Optional[int] = None, label: str = "",
                  require_documents: bool = False) -> Stats:
    """Tokenize lines [start_line, stop_line) of args.input into `{prefix}_{key}_document.*`
    (written under temporary names and renamed at the end, so a failure leaves nothing)."""
    Encoder.init(tok_cfg, args.json_keys, args.append_eod, args.input)
    builders = {key: IndexedDatasetBuilder(data_file_path(output_prefix(prefix, key)), Encoder.dtype)
                for key in args.json_keys}
    stats = Stats()
    lines = iter_lines(args.input, start_line, stop_line)
    pool = None
    if workers > 1:
        pool = mp.Pool(workers, initializer=Encoder.init,
                       initargs=(tok_cfg, args.json_keys, args.append_eod, args.input))
        results = pool.imap(Encoder.encode, lines, chunksize=args.chunk_size)
    else:
        results = map(Encoder.encode, lines)
    start = time.time()
    completed = False
    try:
        for lineno, docs, error, nbytes in results:
            if error is not None:
                if args.strict:
                    raise JsonlError(error)
                stats.bad_lines += 1
                if len(stats.warnings) < _MAX_WARNINGS:
                    stats.warnings.append(error)
                    print(f"warning: skipped {error}", file=sys.stderr)
                continue
            stats.text_bytes += nbytes
            for key, doc in zip(args.json_keys, docs):
                if doc is None:
                    stats.empty += 1
                    continue
                builders[key].add_document(doc)
                stats.tokens += int(doc.size)
                stats.written[key] = stats.written.get(key, 0) + 1
            stats.documents += 1
            if args.log_interval and stats.documents % args.log_interval == 0:
                _progress(stats, start, label)
        if require_documents and _empty_keys(args, stats):
            raise _no_documents(args, stats)
        completed = True
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        if not completed:  # leave no .bin without its .idx behind
            for builder in builders.values():
                builder.abort()
    for key, builder in builders.items():
        builder.finalize(index_file_path(output_prefix(prefix, key)))
    return stats


def _partition_main(args, tok_cfg, prefix, workers, start_line, stop_line, index, queue) -> None:
    try:
        queue.put((index, process_range(args, tok_cfg, prefix, workers, start_line, stop_line,
                                        label=f"[partition {index}] "), None, False))
    except (ValueError, OSError) as exc:  # bad input: the parent reports it as such
        queue.put((index, None, str(exc), True))
    except BaseException as exc:  # report to the parent instead of dying silently
        queue.put((index, None, f"{type(exc).__name__}: {exc}", False))


def run(args: argparse.Namespace) -> Stats:
    tok_cfg = TokenizerConfig(tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                              vocab_file=args.vocab_file, merge_file=args.merge_file, vocab_size=args.vocab_size)
    tok_cfg.validate()
    if not os.path.isfile(args.input):
        raise FileNotFoundError(f"input file not found: {args.input}")
    build_tokenizer(tok_cfg)  # a bad tokenizer file fails here, before any output exists
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"--output-prefix {args.output_prefix}: {out_dir} is a file")
    existing = [path for key in args.json_keys for path in (data_file_path(output_prefix(args.output_prefix, key)),
                                                             index_file_path(output_prefix(args.output_prefix, key)))
                if os.path.exists(path)]
    if existing and not args.overwrite:
        raise ValueError(f"--output-prefix {args.output_prefix}: {existing[0]} already exists; choose another prefix, "
                         f"or pass --overwrite to replace it (the old files stay until the new ones are complete)")
    created = not os.path.exists(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    try:
        if args.partitions <= 1:
            return process_range(args, tok_cfg, args.output_prefix, args.workers, require_documents=True)
        return _run_partitions(args, tok_cfg)
    except BaseException:
        if created and not os.listdir(out_dir):
            os.rmdir(out_dir)  # a failed run leaves nothing behind
        raise


def _run_partitions(args: argparse.Namespace, tok_cfg: TokenizerConfig) -> Stats:
    total = count_lines(args.input)
    bounds = [total * i // args.partitions for i in range(args.partitions + 1)]
    workers_each = max(1, args.workers // args.partitions)
    part_prefixes = [f"{args.output_prefix}_part{i:03d}" for i in range(args.partitions)]
    queue: mp.Queue = mp.Queue()
    procs = [mp.Process(target=_partition_main, args=(args, tok_cfg, part_prefixes[i], workers_each,
                                                      bounds[i], bounds[i + 1], i, queue))
             for i in range(args.partitions)]
    for p in procs:
        p.start()
    results: Dict[int, Stats] = {}
    errors, user_errors = [], []
    for _ in procs:
        index, stats, error, is_user_error = queue.get()
        if error:
            (user_errors if is_user_error else errors).append(error if is_user_error else f"partition {index}: {error}")
        else:
            results[index] = stats
    for p in procs:
        p.join()
    try:
        if errors:
            raise RuntimeError("; ".join(errors))
        if user_errors:
            raise ValueError(user_errors[0])
        total = Stats()
        for i in range(args.partitions):
            total.add(results[i])
        if _empty_keys(args, total):
            raise _no_documents(args, total)
        dtype = optimal_token_dtype(build_tokenizer(tok_cfg).vocab_size)
        for key in args.json_keys:
            merged = IndexedDatasetBuilder(data_file_path(output_prefix(args.output_prefix, key)), dtype)
            try:
                for part in part_prefixes:
                    merged.add_index(output_prefix(part, key))
            except BaseException:
                merged.abort()
                raise
            merged.finalize(index_file_path(output_prefix(args.output_prefix, key)))
    finally:
        for part in part_prefixes:
            for key in args.json_keys:
                for path in (data_file_path(output_prefix(part, key)), index_file_path(output_prefix(part, key))):
                    if os.path.exists(path):
                        os.unlink(path)
    return total


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="JSONL file, optionally gzip-compressed (.gz)")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract, one output pair each")
    g.add_argument("--keep-newlines", action="store_true",
                   help="accepted for Megatron compatibility: documents are never split into sentences "
                        "here, so newlines are always kept")
    g.add_argument("--strict", action="store_true", help="stop at the first bad line instead of skipping it")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer only")
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document token to each document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    g.add_argument("--overwrite", action="store_true",
                   help="replace existing output files of this prefix (without it they are refused)")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes (in total over partitions)")
    g.add_argument("--partitions", type=int, default=1, help="input line ranges processed in parallel, then merged")
    g.add_argument("--chunk-size", type=int, default=16, help="documents per task sent to a worker")
    g.add_argument("--log-interval", type=int, default=1000, help="documents between progress lines (0: none)")
    return p


def main(argv=None) -> Stats:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.workers < 1 or args.partitions < 1:
        parser.error("--workers and --partitions must be >= 1")
    if args.chunk_size < 1:
        parser.error(f"--chunk-size must be >= 1 (got {args.chunk_size})")
    if args.log_interval < 0:
        parser.error(f"--log-interval must be >= 0 (got {args.log_interval})")
    start = time.time()
    try:
        stats = run(args)
    except (ValueError, OSError) as exc:  # bad input (JsonlError, tokenizer files, disk full): exit 2, no traceback
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    elapsed = max(time.time() - start, 1e-9)
    outputs = ", ".join(output_prefix(args.output_prefix, k) + ".{bin,idx}" for k in args.json_keys)
    print(f"done: {stats.documents} documents, {stats.tokens} tokens, {stats.empty} empty documents skipped, "
          f"{stats.bad_lines} bad lines skipped; {stats.text_bytes / 1e6:.2f} MB in {elapsed:.1f} s "
          f"({stats.documents / elapsed:.1f} docs/s, {stats.text_bytes / elapsed / 1e6:.2f} MB/s) -> {outputs}",
          file=sys.stderr)
    return stats


if __name__ == "__main__":
    main()
