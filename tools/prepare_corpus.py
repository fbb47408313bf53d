#!/usr/bin/env python
"""A JSONL corpus to a trained tokenizer and train/valid/test .bin/.idx, held out by document.

    python tools/prepare_corpus.py --input ../shared/data/docs-corpus.jsonl.gz \\
        --output-dir data/docs-corpus --name docs_corpus --vocab-size 4096 --workers 2

writes, under --output-dir (ignored by git: never commit it),

    {name}_{train,valid,test}.jsonl.gz            the corpus split by document
    {name}_sp{V}.model / .vocab                    SentencePiece BPE trained on the train split
    {name}_{train,valid,test}_text_document.bin/.idx   each split tokenized, EOD appended

Document i (0-based, in file order) is held out for validation when i % --heldout-every is 0
and for test when it is 1: a document is in exactly one split, so no held-out text was seen in
training, whatever the sequence length. The input should be shuffled by document (docs-corpus
is); otherwise every k-th document is still a fair sample only if the file's order is.
The tokenizer sees the train split's first --tokenizer-text-bytes of text (deterministic).

Train with Megatron's per-split flags (each file used whole; --split does not apply):

    --train-data-path data/docs-corpus/docs_corpus_train_text_document
    --valid-data-path data/docs-corpus/docs_corpus_valid_text_document
    --test-data-path  data/docs-corpus/docs_corpus_test_text_document
    --tokenizer-type SentencePieceTokenizer --tokenizer-model data/docs-corpus/docs_corpus_sp4k.model

Each step is skipped when its outputs exist (a stopped run resumes; --overwrite redoes all).
"""

from __future__ import annotations

import argparse
import gzip
import os
import time
from contextlib import ExitStack
from typing import Dict, List

import _bootstrap  # noqa: F401
import preprocess_data
import train_tokenizer
from megatron_lsgd import cli
from megatron_lsgd.core.datasets.indexed_dataset import data_file_path, index_file_path
from megatron_lsgd.core.datasets.jsonl import iter_lines, parse_line
from megatron_lsgd.core.output_files import remove_path, written_or_removed

SPLITS = ("train", "valid", "test")


def split_of(index: int, heldout_every: int) -> str:
    """Which split document `index` belongs to: valid at 0, test at 1 (mod heldout_every)."""
    slot = index % heldout_every
    return "valid" if slot == 0 else "test" if slot == 1 else "train"


def vocab_label(vocab_size: int) -> str:
    return f"{vocab_size // 1024}k" if vocab_size % 1024 == 0 else str(vocab_size)


def paths(out_dir: str, name: str, vocab_size: int) -> Dict[str, str]:
    out = {f"{s}_jsonl": os.path.join(out_dir, f"{name}_{s}.jsonl.gz") for s in SPLITS}
    out.update({f"{s}_prefix": os.path.join(out_dir, f"{name}_{s}") for s in SPLITS})
    out["tokenizer"] = os.path.join(out_dir, f"{name}_sp{vocab_label(vocab_size)}")
    return out


def split_documents(src: str, outputs: Dict[str, str], heldout_every: int, key: str) -> Dict[str, int]:
    """Write each document of `src` to its split's JSONL.gz (lines copied as they are; a line
    that is not a JSON object with a string `key` is an error naming its line). Written into a
    temporary directory and moved when all three are complete: a failure leaves nothing."""
    counts = {s: 0 for s in SPLITS}
    tmp_dir = os.path.join(os.path.dirname(outputs["train"]) or ".", ".split.tmp")
    remove_path(tmp_dir)
    os.makedirs(tmp_dir)
    with written_or_removed(tmp_dir, report_as=os.path.dirname(outputs["train"]) or "."):
        tmp = {s: os.path.join(tmp_dir, os.path.basename(outputs[s])) for s in SPLITS}
        with ExitStack() as stack:
            files = {s: stack.enter_context(gzip.GzipFile(tmp[s], mode="wb", mtime=0, compresslevel=3))
                     for s in SPLITS}
            for index, (lineno, line) in enumerate(iter_lines(src)):
                parsed = parse_line(line, [key], lineno, src)
                if parsed.error:
                    raise ValueError(f"--input {parsed.error}")
                s = split_of(index, heldout_every)
                files[s].write(line.rstrip(b"\r\n") + b"\n")
                counts[s] += 1
                if (index + 1) % 10000 == 0:
                    print(f"  split: {index + 1:,} documents", flush=True)
        for s in SPLITS:
            os.replace(tmp[s], outputs[s])
    remove_path(tmp_dir)
    return counts


def dataset_exists(prefix: str) -> bool:
    return os.path.exists(data_file_path(prefix)) and os.path.exists(index_file_path(prefix))


def main(argv: List[str] = None) -> None:
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="JSONL or JSONL.gz, one document per line, shuffled")
    p.add_argument("--json-key", default="text")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--name", default="corpus", help="file-name stem of every output")
    p.add_argument("--vocab-size", type=int, default=4096,
                   help="SentencePiece pieces (the id count adds Megatron's 5 specials); see docs/data.md for "
                        "why 4096 for the small models of the quality ladder")
    p.add_argument("--heldout-every", type=int, default=100,
                   help="one document in this many to validation and one to test")
    p.add_argument("--tokenizer-text-bytes", type=int, default=40_000_000,
                   help="train the tokenizer on the train split's first this many bytes of text")
    p.add_argument("--workers", type=int, default=2, help="tokenizer processes for the .bin/.idx step")
    p.add_argument("--overwrite", action="store_true", help="redo every step even if its outputs exist")
    args = p.parse_args(argv)
    if args.heldout_every < 3:
        p.error(f"--heldout-every must be >= 3 (one valid, one test and at least one train document per "
                f"{args.heldout_every}), got {args.heldout_every}")
    if args.vocab_size < 4:
        p.error(f"--vocab-size must be >= 4 (got {args.vocab_size})")
    if args.tokenizer_text_bytes <= 0:
        p.error(f"--tokenizer-text-bytes must be > 0 (got {args.tokenizer_text_bytes})")
    if args.workers < 1:
        p.error(f"--workers must be >= 1 (got {args.workers})")
    with cli.user_errors():
        if not os.path.isfile(args.input):
            raise FileNotFoundError(f"--input {args.input} does not exist")
        os.makedirs(args.output_dir, exist_ok=True)
        prepare(args)


def prepare(args) -> None:
    out = paths(args.output_dir, args.name, args.vocab_size)
    t0 = time.perf_counter()
    jsonl = {s: out[f"{s}_jsonl"] for s in SPLITS}
    if args.overwrite or not all(os.path.exists(f) for f in jsonl.values()):
        print(f"[1/3] splitting {args.input} by document (1 in {args.heldout_every} to valid, 1 to test)", flush=True)
        counts = split_documents(args.input, jsonl, args.heldout_every, args.json_key)
        print("  documents: " + ", ".join(f"{s} {counts[s]:,}" for s in SPLITS), flush=True)
    else:
        print("[1/3] split by document: outputs exist, kept", flush=True)
    model = out["tokenizer"] + ".model"
    if args.overwrite or not os.path.exists(model):
        print(f"[2/3] training the tokenizer ({args.vocab_size} pieces) on the train split's first "
              f"{args.tokenizer_text_bytes / 1e6:.0f} MB of text", flush=True)
        train_tokenizer.main(["--input", jsonl["train"], "--json-keys", args.json_key, "--model-prefix",
                              out["tokenizer"], "--vocab-size", str(args.vocab_size), "--max-text-bytes",
                              str(args.tokenizer_text_bytes)])
    else:
        print(f"[2/3] tokenizer {model}: exists, kept", flush=True)
    for s in SPLITS:
        prefix = out[f"{s}_prefix"] + f"_{args.json_key}_document"
        if not args.overwrite and dataset_exists(prefix):
            print(f"[3/3] {prefix}.bin/.idx: exist, kept", flush=True)
            continue
        print(f"[3/3] tokenizing the {s} split -> {prefix}.bin/.idx", flush=True)
        preprocess_data.main(["--input", jsonl[s], "--json-keys", args.json_key, "--tokenizer-type",
                              "SentencePieceTokenizer", "--tokenizer-model", model, "--append-eod", "--output-prefix",
                              out[f"{s}_prefix"], "--workers", str(args.workers), "--log-interval", "5000",
                              "--overwrite"])
    print(f"done in {time.perf_counter() - t0:.0f} s: tokenizer {model}; data "
          + ", ".join(out[f"{s}_prefix"] + f"_{args.json_key}_document" for s in SPLITS), flush=True)


if __name__ == "__main__":
    main()
