#!/usr/bin/env python
"""Deterministic slice of a JSONL corpus: every k-th document, up to a byte budget of text.

    python tools/slice_jsonl.py --input ../shared/data/python-docs-3.11.jsonl.gz \\
        --output data/python-docs/python-docs-3.11-slice.jsonl.gz --every 2 --max-text-bytes 5000000
"""

from __future__ import annotations

import argparse
import gzip
import json

import _bootstrap  # noqa: F401
from megatron_lsgd import cli
from megatron_lsgd.core.datasets.jsonl import iter_lines, parse_line
from megatron_lsgd.core.output_files import written_or_removed


def main(argv=None) -> None:
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True, help="ends in .gz to compress (written with mtime 0, reproducible)")
    p.add_argument("--json-key", default="text")
    p.add_argument("--every", type=int, default=1, help="keep documents 0, k, 2k, ... in file order")
    p.add_argument("--max-text-bytes", type=int, default=None, help="stop before the kept text exceeds this")
    args = p.parse_args(argv)
    if args.every < 1:
        p.error(f"--every must be >= 1 (got {args.every})")
    if args.max_text_bytes is not None and args.max_text_bytes < 0:
        p.error(f"--max-text-bytes must be >= 0 (got {args.max_text_bytes})")
    with cli.user_errors():
        kept, text_bytes = write_slice(args)
    print(f"kept {kept} documents, {text_bytes / 1e6:.2f} MB of text -> {args.output}")


def write_slice(args) -> tuple:
    kept, text_bytes, out_lines = 0, 0, []
    for index, (lineno, line) in enumerate(iter_lines(args.input)):
        if index % args.every:
            continue
        parsed = parse_line(line, [args.json_key], lineno, args.input)
        if parsed.error:
            raise ValueError(parsed.error)
        size = len(parsed.texts[0].encode("utf-8"))
        if args.max_text_bytes is not None and text_bytes + size > args.max_text_bytes:
            break
        out_lines.append(json.dumps(json.loads(line), ensure_ascii=False) + "\n")
        kept += 1
        text_bytes += size
    payload = "".join(out_lines).encode("utf-8")
    with written_or_removed(args.output):
        if args.output.endswith(".gz"):
            with open(args.output, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as f:
                f.write(payload)
        else:
            with open(args.output, "wb") as f:
                f.write(payload)
    return kept, text_bytes


if __name__ == "__main__":
    main()
