"""The corpus shipped in data/python-docs/ is consistent, reproducible and learnable."""

from __future__ import annotations

import filecmp
import gzip
import json

import numpy as np
import pytest

import preprocess_data
import train_tokenizer
from megatron_lsgd.core.datasets import IndexedDataset
from megatron_lsgd.training.tokenizer import TokenizerConfig, build_tokenizer

from datatest_utils import CORPUS_JSONL, CORPUS_PREFIX, SP_MODEL


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TokenizerConfig("SentencePieceTokenizer", tokenizer_model=SP_MODEL))


def test_shipped_dataset_matches_tokenizer_and_text(tokenizer):
    ds = IndexedDataset(CORPUS_PREFIX)
    with gzip.open(CORPUS_JSONL, "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    assert ds.dtype == np.uint16 and len(ds) == ds.num_documents == len(texts)
    assert all(ds[i][-1] == tokenizer.eod for i in (0, len(ds) // 2, len(ds) - 1))
    assert tokenizer.detokenize(ds[0][:-1]) == texts[0]
    assert int(ds.sequence_lengths.astype(np.int64).sum()) > 1_000_000


def _model_content(path: str):
    """Pieces, scores and an encoding sample: everything but the output path the model records."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=path)
    pieces = [(sp.id_to_piece(i), sp.get_score(i), sp.is_control(i), sp.is_byte(i)) for i in range(sp.vocab_size())]
    return pieces, sp.encode("def f(x):\n    return x  # ünï 😀")


@pytest.mark.slow
def test_shipped_files_regenerate_identically(tmp_path):
    train_tokenizer.main(["--input", CORPUS_JSONL, "--model-prefix", str(tmp_path / "sp"), "--vocab-size", "8192"])
    assert _model_content(str(tmp_path / "sp.model")) == _model_content(SP_MODEL)
    preprocess_data.main(["--input", CORPUS_JSONL, "--output-prefix", str(tmp_path / "python_docs"),
                          "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", SP_MODEL,
                          "--append-eod", "--workers", "2", "--log-interval", "0"])
    for ext in (".bin", ".idx"):
        assert filecmp.cmp(str(tmp_path / f"python_docs_text_document{ext}"), CORPUS_PREFIX + ext, shallow=False)


@pytest.mark.slow
def test_pretrain_gpt_learns_the_bundled_corpus():
    """The issue's command: pretrain_gpt.py with --data-path and a SentencePiece tokenizer
    trains on the shipped corpus, across two sites, and the loss falls."""
    from tests.unit_tests.harness import logged_losses, run_distributed

    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "40", "--lr", "5e-3",
            "--lr-warmup-iters", "5", "--log-interval", "10", "--eval-interval", "40", "--eval-iters", "2",
            "--data-path", CORPUS_PREFIX, "--split", "949,50,1", "--tokenizer-type", "SentencePieceTokenizer",
            "--tokenizer-model", SP_MODEL, "--num-sites", "2"]
    records = run_distributed(argv, 2)
    losses = logged_losses(records)
    assert len(losses) == 4
    assert losses[0] > 7.0  # starts near ln(8320) ~ 9.0
    assert losses[-1] < losses[0] - 1.5
    assert records[-1]["valid"] and records[-1]["valid"][-1] < losses[0]
