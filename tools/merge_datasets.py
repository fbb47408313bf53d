#!/usr/bin/env python
"""Concatenate several .bin/.idx pairs (same dtype) into one, in the order given.

    python tools/merge_datasets.py --input out/a_text_document out/b_text_document \\
        --output-prefix out/merged_text_document

--input also accepts directories: every complete .bin/.idx pair in them, sorted by name.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List

import _bootstrap  # noqa: F401
from megatron_lsgd import cli
from megatron_lsgd.core.datasets.indexed_dataset import (IndexedDataset, IndexedDatasetBuilder, data_file_path,
                                                         exists, index_file_path)


def expand_inputs(inputs: List[str]) -> List[str]:
    prefixes: List[str] = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(os.path.join(item, name[:-4]) for name in os.listdir(item) if name.endswith(".idx"))
            prefixes.extend(p for p in found if exists(p))
        else:
            prefixes.append(item[:-4] if item.endswith((".bin", ".idx")) else item)
    if not prefixes:
        raise FileNotFoundError(f"no .bin/.idx pairs found in {inputs}")
    return prefixes


def merge(prefixes: List[str], output_prefix: str) -> int:
    """Merge and return the number of documents written."""
    first = IndexedDataset(prefixes[0])  # also validates the first input before anything is written
    dtype = first.dtype
    first.close()
    out_abs = os.path.abspath(output_prefix)
    if any(os.path.abspath(p) == out_abs for p in prefixes):
        raise ValueError(f"output prefix {output_prefix} is also an input")
    builder = IndexedDatasetBuilder(data_file_path(output_prefix), dtype)
    try:
        for prefix in prefixes:
            builder.add_index(prefix)
    except BaseException:
        builder.abort()
        raise
    builder.finalize(index_file_path(output_prefix))
    merged = IndexedDataset(output_prefix)
    n = merged.num_documents
    merged.close()
    return n


def main(argv=None) -> None:
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="dataset prefixes or directories")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    args = p.parse_args(argv)
    try:
        prefixes = expand_inputs(args.input)
        n = merge(prefixes, args.output_prefix)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    print(f"merged {len(prefixes)} datasets, {n} documents -> {args.output_prefix}.{{bin,idx}}", file=sys.stderr)


if __name__ == "__main__":
    main()
