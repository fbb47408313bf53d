"""The corpus shipped in data/python-docs/ is consistent, reproducible and learnable."""

from __future__ import annotations

import filecmp
import gzip
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import preprocess_data
import train_tokenizer
from megatron_lsgd.core.datasets import DataConfig, IndexedDataset, build_train_valid_test_datasets
from megatron_lsgd.training.tokenizer import TokenizerConfig, build_tokenizer, padded_vocab_size

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
def test_loss_falls_on_bundled_corpus(tokenizer):
    """A bigram model trained for a few steps on the train split: the data is learnable."""
    cfg = DataConfig(data_path=[CORPUS_PREFIX], split="949,50,1", seq_length=128, seed=1234)
    train, valid, test = build_train_valid_test_datasets(cfg, tokenizer, (16 * 40, 16, 4))
    assert valid is not None and test is not None
    vocab = padded_vocab_size(tokenizer.vocab_size, 128, 1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, 32), torch.nn.Linear(32, vocab))
    torch.nn.init.zeros_(model[1].weight)
    torch.nn.init.zeros_(model[1].bias)
    opt = torch.optim.Adam(model.parameters(), lr=0.03)
    losses = []
    for step in range(40):
        batch = [train[step * 16 + i] for i in range(16)]
        tokens = torch.stack([b["tokens"] for b in batch])
        labels = torch.stack([b["labels"] for b in batch])
        mask = torch.stack([b["loss_mask"] for b in batch]).view(-1)
        loss_tok = F.cross_entropy(model(tokens).view(-1, vocab), labels.view(-1), reduction="none")
        loss = (loss_tok * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(np.log(vocab), rel=1e-4)
    assert np.mean(losses[-5:]) < losses[0] - 2.0
