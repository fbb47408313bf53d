#!/usr/bin/env python
"""Train a sentencepiece model on JSONL corpora (deterministic settings).

    python tools/train_tokenizer.py --input data/python-docs/python-docs-3.11-slice.jsonl.gz \\
        --model-prefix data/python-docs/python_docs_sp8k --vocab-size 8192

Documents are fed line by line (sentencepiece's unit is a sentence, at most
--max-sentence-length bytes). Newlines are kept as a user-defined "\\n" piece and
whitespace is not collapsed, so code and reStructuredText indentation survive a round trip.
Training is single-threaded and unshuffled by default so the same input gives the same model.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Iterator, List, Optional

import _bootstrap  # noqa: F401
from megatron_lsgd import cli
from megatron_lsgd.core.datasets.jsonl import iter_lines, parse_line


def iter_sentences(paths: List[str], keys: List[str], max_bytes: int, counts: dict,
                   max_text_bytes: Optional[int] = None) -> Iterator[str]:
    """Each line of each document, in file order; with `max_text_bytes`, only the documents
    before that much text (a deterministic sample of a large, shuffled corpus)."""
    fed = 0
    for path in paths:
        for lineno, line in iter_lines(path):
            parsed = parse_line(line, keys, lineno, path)
            if parsed.error:
                counts["bad_lines"] += 1
                if counts["bad_lines"] <= 10:
                    print(f"warning: skipped {parsed.error}", file=sys.stderr)
                continue
            if max_text_bytes is not None and fed >= max_text_bytes:
                return
            for text in parsed.texts:
                fed += len(text.encode("utf-8"))
                for sentence in text.split("\n"):
                    if sentence.strip() and len(sentence.encode("utf-8")) <= max_bytes:
                        yield sentence


def main(argv=None) -> None:
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, nargs="+", help="JSONL or JSONL.gz files")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    p.add_argument("--character-coverage", type=float, default=0.9995)
    p.add_argument("--max-sentence-length", type=int, default=4192, help="bytes; longer lines are skipped")
    p.add_argument("--max-text-bytes", type=int, default=None,
                   help="train on the documents before this much text only (in file order; a large corpus "
                        "is sampled deterministically this way)")
    p.add_argument("--num-threads", type=int, default=1, help=">1 is faster but may change the model")
    args = p.parse_args(argv)
    if args.max_text_bytes is not None and args.max_text_bytes <= 0:
        p.error(f"--max-text-bytes must be > 0 (got {args.max_text_bytes})")
    if args.vocab_size < 4:  # <unk>, <s>, </s> and the newline piece are always there
        p.error(f"--vocab-size must be >= 4 (got {args.vocab_size})")
    with cli.user_errors():
        counts = train(args)
    print(f"wrote {args.model_prefix}.model and {args.model_prefix}.vocab "
          f"(vocab {args.vocab_size}, {counts['bad_lines']} bad lines skipped)")


def train(args) -> dict:
    import sentencepiece as spm  # noqa: PLC0415

    for path in args.input:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--input {path} does not exist")
    counts = {"bad_lines": 0}
    try:
        _train(spm, args, counts)
    except RuntimeError as err:  # sentencepiece reports a corpus that cannot give this model as RuntimeError
        reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        reason = re.sub(r"^.*\]\s*", "", reason)  # without its C++ source position and check expression
        flag = "--vocab-size" if "ocab" in reason else "--input"
        raise ValueError(f"{flag}: sentencepiece cannot train this model on this corpus: {reason}") from None
    return counts


def _train(spm, args, counts: dict) -> None:
    spm.SentencePieceTrainer.Train(
        sentence_iterator=iter_sentences(args.input, args.json_keys, args.max_sentence_length, counts,
                                         getattr(args, "max_text_bytes", None)),
        model_prefix=args.model_prefix,
        vocab_size=args.vocab_size,
        model_type=args.model_type,
        character_coverage=args.character_coverage,
        max_sentence_length=args.max_sentence_length,
        num_threads=args.num_threads,
        shuffle_input_sentence=False,
        input_sentence_size=0,
        byte_fallback=True,  # any byte is encodable: no <unk> for rare characters
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        user_defined_symbols=["\n"],
        bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
        minloglevel=2,
    )


if __name__ == "__main__":
    main()
