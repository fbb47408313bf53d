"""GPT dataset indices and samples, masks, splits, blending, cache and tokenizer checks."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle

import numpy as np
import pytest
import torch

from megatron_lsgd.core.datasets import (BlendedDataset, DataConfig, GPTDataset, IndexedDataset, MockGPTDataset,
                                         build_train_valid_test_datasets, data_passes, parse_data_path,
                                         parse_split, split_ranges)
from megatron_lsgd.training.tokenizer import NullTokenizer

from datatest_utils import random_docs, write_dataset

VOCAB = 100
EOD = VOCAB - 1


@pytest.fixture
def corpus(tmp_path, rng):
    docs = random_docs(rng, 50, VOCAB, EOD)
    return write_dataset(str(tmp_path / "corpus_text_document"), docs), docs


def _dataset(prefix, num_samples=40, seq_length=16, seed=7, **kw):
    ds = IndexedDataset(prefix)
    return GPTDataset(ds, np.arange(len(ds)), num_samples, seq_length, seed, "train", EOD, VOCAB, **kw)


def test_samples_are_windows_of_the_shuffled_stream(corpus):
    prefix, docs = corpus
    gpt = _dataset(prefix, num_samples=200, seq_length=16)
    stream = np.concatenate([docs[d] for d in gpt.doc_idx])
    assert len(gpt) >= 200
    for idx in range(len(gpt)):
        i = int(gpt.shuffle_idx[idx])
        expected = stream[i * 16: i * 16 + 17]
        np.testing.assert_array_equal(gpt.sample_tokens(idx), expected)
    sample = gpt[3]
    assert sample["tokens"].dtype == torch.int64 and sample["tokens"].shape == (16,)
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])
    assert sample["loss_mask"].dtype == torch.float32 and "attention_mask" not in sample


def test_pickles_by_path(corpus):
    prefix, _ = corpus
    gpt = _dataset(prefix)
    clone = pickle.loads(pickle.dumps(gpt))
    assert len(pickle.dumps(gpt.indexed)) < 500  # the memmapped token buffer is not copied
    assert all(torch.equal(gpt[i]["tokens"], clone[i]["tokens"]) for i in range(len(gpt)))


def test_epochs_visit_every_document_once(corpus):
    prefix, docs = corpus
    gpt = _dataset(prefix, num_samples=300)
    total_tokens = sum(len(d) for d in docs)
    epochs = len(gpt.doc_idx) // len(docs)
    assert epochs * total_tokens >= 300 * 16 + 1 > (epochs - 1) * total_tokens
    for e in range(epochs):
        assert sorted(gpt.doc_idx[e * len(docs):(e + 1) * len(docs)].tolist()) == list(range(len(docs)))


def test_deterministic_for_a_seed(corpus):
    prefix, _ = corpus
    a, b, c = _dataset(prefix, seed=3), _dataset(prefix, seed=3), _dataset(prefix, seed=4)
    assert all(torch.equal(a[i]["tokens"], b[i]["tokens"]) for i in range(len(a)))
    np.testing.assert_array_equal(a.shuffle_idx, b.shuffle_idx)
    assert not np.array_equal(a.doc_idx, c.doc_idx)


def _reference_masks(tokens, eod):
    """Megatron's loop-based construction, for comparison."""
    s = len(tokens)
    mask = np.tril(np.ones((s, s)))
    pos = np.arange(s)
    prev = 0
    for i in np.flatnonzero(tokens == eod):
        mask[i + 1:, : i + 1] = 0
        pos[i + 1:] -= i + 1 - prev
        prev = i + 1
    return mask < 0.5, pos


def test_masks_and_position_ids(corpus):
    prefix, _ = corpus
    gpt = _dataset(prefix, seq_length=64, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
    seen_eod = 0
    for idx in range(len(gpt)):
        s = gpt[idx]
        tokens = s["tokens"].numpy()
        mask, pos = _reference_masks(tokens, EOD)
        assert s["attention_mask"].dtype == torch.bool and s["attention_mask"].shape == (1, 64, 64)
        np.testing.assert_array_equal(s["attention_mask"][0].numpy(), mask)
        np.testing.assert_array_equal(s["position_ids"].numpy(), pos)
        np.testing.assert_array_equal(s["loss_mask"].numpy(), (tokens != EOD).astype(np.float32))
        seen_eod += int((tokens == EOD).sum())
    assert seen_eod > 0
    plain = _dataset(prefix, seq_length=64)[0]
    assert torch.equal(plain["position_ids"], torch.arange(64)) and plain["loss_mask"].min() == 1


def test_parse_data_path_and_split():
    assert parse_data_path(["a"]) == (["a"], None)
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    with pytest.raises(ValueError, match="weight prefix"):
        parse_data_path(["0.3", "a", "b"])
    assert parse_split("949,50,1") == pytest.approx([0.949, 0.05, 0.001])
    assert parse_split("1") == [1.0, 0.0, 0.0]
    assert split_ranges(1000, parse_split("949,50,1")) == [(0, 949), (949, 999), (999, 1000)]
    # A small corpus still gets one document in every split with a positive weight.
    assert split_ranges(237, parse_split("949,50,1")) == [(0, 224), (224, 236), (236, 237)]
    assert split_ranges(10, parse_split("8,2,0")) == [(0, 8), (8, 10), (10, 10)]


def test_build_single_dataset_splits(corpus):
    prefix, _ = corpus
    cfg = DataConfig(data_path=[prefix], split="80,10,10", seq_length=8, seed=1)
    train, valid, test = build_train_valid_test_datasets(cfg, NullTokenizer(VOCAB), (100, 20, 0))
    assert isinstance(train, GPTDataset) and len(train) >= 100 and len(valid) >= 20 and test is None
    assert set(train.doc_idx.tolist()) == set(range(40)) and set(valid.doc_idx.tolist()) == set(range(40, 45))
    cfg.split = "1,0,0"
    assert build_train_valid_test_datasets(cfg, NullTokenizer(VOCAB), (10, 10, 10))[1:] == (None, None)


def test_blended_proportions(tmp_path, rng):
    a = write_dataset(str(tmp_path / "a"), random_docs(rng, 30, VOCAB, EOD))
    b = write_dataset(str(tmp_path / "b"), random_docs(rng, 30, VOCAB, EOD))
    cfg = DataConfig(data_path=["0.25", a, "0.75", b], split="1", seq_length=8)
    train, _, _ = build_train_valid_test_datasets(cfg, NullTokenizer(VOCAB), (1000, 0, 0))
    assert isinstance(train, BlendedDataset) and len(train) == 1000
    counts = np.bincount(train.dataset_index, minlength=2)
    assert abs(counts[0] - 250) <= 1 and abs(counts[1] - 750) <= 1
    first_a = train.datasets[0][0]["tokens"]
    assert torch.equal(train[int(np.argmax(train.dataset_index == 0))]["tokens"], first_a)
    # Prefixes without weights blend in proportion to their token counts.
    cfg2 = DataConfig(data_path=[a, b], split="1", seq_length=8)
    train2, _, _ = build_train_valid_test_datasets(cfg2, NullTokenizer(VOCAB), (500, 0, 0))
    ta, tb = (IndexedDataset(p).sequence_lengths.sum() for p in (a, b))
    assert abs(np.bincount(train2.dataset_index)[0] - 500 * ta / (ta + tb)) <= 1


def test_data_passes(tmp_path, rng):
    """Passes over the train split: tokens drawn / the split's tokens; a blend's most repeated part."""
    a = write_dataset(str(tmp_path / "a"), random_docs(rng, 30, VOCAB, EOD))
    b = write_dataset(str(tmp_path / "b"), random_docs(rng, 10, VOCAB, EOD))
    ta, tb = (int(IndexedDataset(p).sequence_lengths[:-1 if p == a else None].sum()) for p in (a, b))
    cfg = DataConfig(data_path=[a], split="29,1,0", seq_length=8)  # 29 of a's 30 documents train
    train, _, _ = build_train_valid_test_datasets(cfg, NullTokenizer(VOCAB), (10, 1, 0))
    tokens, passes = data_passes(train, 3 * ta // 8)
    assert tokens == ta and passes == pytest.approx((3 * ta // 8) * 8 / ta)
    cfg = DataConfig(data_path=["0.5", a, "0.5", b], split="1", seq_length=8)
    blend, _, _ = build_train_valid_test_datasets(cfg, NullTokenizer(VOCAB), (100, 0, 0))
    full_a = int(IndexedDataset(a).sequence_lengths.sum())
    tokens, passes = data_passes(blend, 100)
    assert tokens == full_a + tb and passes == pytest.approx(50 * 8 / min(full_a, tb))  # b (smaller) repeats more
    mock, _, _ = build_train_valid_test_datasets(DataConfig(mock_data=True, seq_length=8), NullTokenizer(VOCAB),
                                                 (10, 0, 0))
    assert data_passes(mock, 10) is None and data_passes(None, 10) is None


def test_dataloader_collates(corpus):
    prefix, _ = corpus
    cfg = DataConfig(data_path=[prefix], split="1", seq_length=8, reset_attention_mask=True)
    train, _, _ = build_train_valid_test_datasets(cfg, NullTokenizer(VOCAB), (12, 0, 0))
    loader = torch.utils.data.DataLoader(train, batch_size=4, num_workers=2)
    batches = list(loader)
    assert batches[0]["tokens"].shape == (4, 8) and batches[0]["attention_mask"].shape == (4, 1, 8, 8)
    assert torch.equal(batches[1]["labels"][0], train[4]["labels"])


def test_mock_data():
    cfg = DataConfig(mock_data=True, seq_length=32, seed=5)
    train, valid, test = build_train_valid_test_datasets(cfg, NullTokenizer(50), (10, 2, 0))
    assert isinstance(train, MockGPTDataset) and len(train) == 10 and len(valid) == 2 and test is None
    assert train[0]["tokens"].shape == (32,) and int(train[0]["tokens"].max()) < 50


def test_cache_is_reused(corpus, tmp_path, monkeypatch):
    prefix, _ = corpus
    cache = str(tmp_path / "cache")
    first = _dataset(prefix, cache_dir=cache)
    files = sorted(os.listdir(cache))
    assert len(files) == 4 and any(f.endswith("GPTDataset-train-description.json") for f in files)

    def fail(*_):
        raise AssertionError("indices rebuilt although cached")

    monkeypatch.setattr(GPTDataset, "_build_indices", fail)
    second = _dataset(prefix, cache_dir=cache)
    np.testing.assert_array_equal(first.sample_idx, second.sample_idx)
    np.testing.assert_array_equal(first.shuffle_idx, second.shuffle_idx)
    with pytest.raises(AssertionError, match="rebuilt"):
        _dataset(prefix, cache_dir=cache, seed=99)  # another config is another key


def _build_in_child(prefix: str, cache: str, queue) -> None:
    gpt = _dataset(prefix, num_samples=2000, cache_dir=cache)
    queue.put(np.asarray(gpt.shuffle_idx[:50]).tolist())


def test_cache_concurrent_builders(corpus, tmp_path):
    prefix, _ = corpus
    cache = str(tmp_path / "cache")
    queue = mp.get_context("fork").Queue()
    procs = [mp.get_context("fork").Process(target=_build_in_child, args=(prefix, cache, queue)) for _ in range(3)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results[0] == results[1] == results[2]
    assert not [f for f in os.listdir(cache) if f.startswith(".tmp-")]
    assert _dataset(prefix, num_samples=2000, cache_dir=cache).shuffle_idx[:50].tolist() == results[0]


def test_tokenizer_dtype_mismatch(corpus):
    prefix, _ = corpus  # uint16 tokens
    cfg = DataConfig(data_path=[prefix], split="1", seq_length=8)
    with pytest.raises(ValueError, match=r"corpus_text_document.idx: tokens are stored as uint16.*100000 ids"):
        build_train_valid_test_datasets(cfg, NullTokenizer(100_000), (10, 0, 0))


def test_token_outside_vocabulary(corpus):
    prefix, _ = corpus  # ids up to 99
    cfg = DataConfig(data_path=[prefix], split="1", seq_length=8)
    train, _, _ = build_train_valid_test_datasets(cfg, NullTokenizer(50), (10, 0, 0))
    with pytest.raises(ValueError, match=r"corpus_text_document.bin: token id \d+ outside the tokenizer's vocabulary"):
        for i in range(len(train)):
            train[i]


def test_empty_split_is_an_error(tmp_path, rng):
    prefix = write_dataset(str(tmp_path / "tiny"), random_docs(rng, 1, VOCAB, EOD))
    cfg = DataConfig(data_path=[prefix], split="50,50,0", seq_length=8)
    with pytest.raises(ValueError, match=r"tiny: the valid split .* has no documents out of 1"):
        build_train_valid_test_datasets(cfg, NullTokenizer(VOCAB), (10, 10, 0))


def test_missing_data_path(tmp_path):
    cfg = DataConfig(data_path=[str(tmp_path / "nope")], split="1", seq_length=8)
    with pytest.raises(FileNotFoundError, match="nope.idx"):
        build_train_valid_test_datasets(cfg, NullTokenizer(VOCAB), (10, 0, 0))
