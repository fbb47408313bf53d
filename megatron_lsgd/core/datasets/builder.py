"""build_train_valid_test_datasets: --data-path / --split / --mock-data to three datasets."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from .blended_dataset import BlendedDataset, normalize_weights
from .config import DataConfig
from .gpt_dataset import GPTDataset
from .helpers import build_blending_indices
from .indexed_dataset import IndexedDataset
from .mock_dataset import MockGPTDataset

SPLIT_NAMES = ("train", "valid", "test")


def parse_data_path(data_path: Sequence[str]) -> Tuple[List[str], Optional[List[float]]]:
    """Megatron's --data-path: `prefix ...` (weights None) or `weight prefix weight prefix ...`."""
    items = list(data_path)
    if not items:
        raise ValueError("--data-path is empty")

    def is_number(x: str) -> bool:
        try:
            float(x)
        except ValueError:
            return False
        return True

    if not any(is_number(x) for x in items):
        return items, None
    if len(items) % 2 or not all(is_number(w) for w in items[0::2]):
        raise ValueError(f"--data-path {' '.join(items)}: expected `weight prefix` pairs or only prefixes")
    weights = [float(w) for w in items[0::2]]
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--data-path weights must be non-negative with a positive sum, got {weights}")
    return items[1::2], weights


def parse_split(split: str) -> List[float]:
    """'949,50,1' -> normalized [train, valid, test] fractions (missing ones are 0)."""
    parts = [float(p) for p in split.replace("/", ",").split(",")]
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return [p / total for p in parts]


def split_ranges(num_sequences: int, fractions: Sequence[float]) -> List[Tuple[int, int]]:
    """Contiguous [start, end) sequence ranges per split, sized by rounded fractions.

    Unlike plain rounding, a split with a positive fraction gets at least one sequence when
    there are enough (taken from the largest split), so `--split 949,50,1` still yields a
    test split on a small corpus.
    """
    counts = [int(f * num_sequences + 0.5) for f in fractions]  # half up, not banker's rounding
    counts[-1] = num_sequences - sum(counts[:-1])
    while counts[-1] < 0:  # rounding overshoot: trim the largest earlier split (the later one on ties)
        largest = max(range(len(counts) - 1), key=lambda i: (counts[i], i))
        counts[largest] -= 1
        counts[-1] += 1
    positive = [i for i, f in enumerate(fractions) if f > 0]
    if num_sequences >= len(positive):
        for i in positive:
            if counts[i] == 0:
                largest = max(range(len(counts)), key=lambda j: counts[j])
                counts[largest] -= 1
                counts[i] += 1
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(int).tolist()
    return [(bounds[i], bounds[i + 1]) for i in range(len(fractions))]


def check_tokenizer_matches(indexed: IndexedDataset, vocab_size: int) -> None:
    dtype = indexed.dtype
    if not np.issubdtype(dtype, np.integer):
        raise ValueError(f"{indexed.idx_path}: dtype {dtype.name} is not a token dtype")
    if vocab_size - 1 > np.iinfo(dtype).max:
        raise ValueError(f"{indexed.idx_path}: tokens are stored as {dtype.name} (max id {np.iinfo(dtype).max}) "
                         f"but the tokenizer's vocabulary has {vocab_size} ids; the dataset was preprocessed "
                         f"with a different tokenizer")


def _gpt_dataset(cfg: DataConfig, tokenizer, indexed: IndexedDataset, rng: Tuple[int, int], num_samples: int,
                 split: str) -> GPTDataset:
    if rng[1] <= rng[0]:
        where = f"--{split}-data-path" if cfg.per_split else f"--split {cfg.split}"
        raise ValueError(f"{indexed.path_prefix}: the {split} split ({where}) has no documents "
                         f"out of {len(indexed)}; {num_samples} samples were requested")
    return GPTDataset(
        indexed, np.arange(rng[0], rng[1], dtype=np.int64), num_samples, cfg.seq_length, cfg.seed, split,
        eod=tokenizer.eod, vocab_size=tokenizer.vocab_size, eod_mask_loss=cfg.eod_mask_loss,
        reset_position_ids=cfg.reset_position_ids, reset_attention_mask=cfg.reset_attention_mask,
        cache_dir=cfg.data_cache_path)


def build_train_valid_test_datasets(cfg: DataConfig, tokenizer, num_samples: Sequence[int]
                                    ) -> Tuple[Optional[torch.utils.data.Dataset], ...]:
    """Three datasets (train, valid, test); None where the split weight or the request is 0.

    Called on every rank; all indices are deterministic functions of the config.
    """
    cfg.validate(need_train_data=num_samples[0] > 0)
    if len(num_samples) != 3:
        raise ValueError(f"num_samples must be (train, valid, test), got {num_samples}")
    if cfg.mock_data:
        return tuple(MockGPTDataset(int(n), cfg.seq_length, tokenizer.vocab_size, cfg.seed, name) if n > 0 else None
                     for n, name in zip(num_samples, SPLIT_NAMES))

    if cfg.per_split:  # each split's own files, used whole
        return tuple(_split_dataset(cfg, tokenizer, cfg.split_paths(name), None, int(n), name)
                     if n > 0 and cfg.split_paths(name) else None for n, name in zip(num_samples, SPLIT_NAMES))
    fractions = parse_split(cfg.split)
    return tuple(_split_dataset(cfg, tokenizer, cfg.data_path, fractions, int(n), name) if n > 0 and fractions[s] > 0
                 else None for s, (n, name) in enumerate(zip(num_samples, SPLIT_NAMES)))


def _split_dataset(cfg: DataConfig, tokenizer, data_path: Sequence[str], fractions: Optional[Sequence[float]],
                   n: int, name: str) -> torch.utils.data.Dataset:
    """Split `name`'s dataset of `n` samples from `data_path` (prefixes, or weight prefix pairs):
    each file's `fractions` share for that split, or (fractions None) the whole file."""
    prefixes, weights = parse_data_path(data_path)
    indexed = [IndexedDataset(p, mmap=cfg.mmap_bin_files) for p in prefixes]
    for ds in indexed:
        check_tokenizer_matches(ds, tokenizer.vocab_size)
    if weights is None:  # plain list of prefixes: blend in proportion to their tokens
        weights = [float(ds.sequence_lengths.astype(np.int64).sum()) for ds in indexed]
    s = SPLIT_NAMES.index(name)
    ranges = [split_ranges(len(ds), fractions)[s] if fractions is not None else (0, len(ds)) for ds in indexed]
    if len(indexed) == 1:
        return _gpt_dataset(cfg, tokenizer, indexed[0], ranges[0], n, name)
    w = normalize_weights(weights)
    # Size each component by what the blend will actually draw from it.
    dataset_index, _ = build_blending_indices(w, n)
    counts = np.bincount(dataset_index, minlength=len(indexed))
    parts = [_gpt_dataset(cfg, tokenizer, ds, r, int(c), name) if c > 0 else None
             for ds, r, c in zip(indexed, ranges, counts)]
    return BlendedDataset(parts, w, n)


def data_passes(dataset: Optional[torch.utils.data.Dataset], samples: int) -> Optional[Tuple[int, float]]:
    """(tokens in the split, passes over it) when `samples` samples are read from `dataset`;
    for a blend, its most repeated part's. None for mock data, which has no split to repeat.

    A model that reads its data more than once fits what it repeats: its training loss then
    says less about held-out data, and a gap between two runs measured there shrinks (or
    grows) for reasons that are not the runs' own.
    """
    if isinstance(dataset, GPTDataset):
        return dataset.tokens_per_epoch, samples * dataset.seq_length / dataset.tokens_per_epoch
    if isinstance(dataset, BlendedDataset):
        parts = [(part, w) for part, w in zip(dataset.datasets, dataset.weights) if isinstance(part, GPTDataset)]
        if not parts:
            return None
        shares = [data_passes(part, w * samples) for part, w in parts]
        return sum(t for t, _ in shares), max(p for _, p in shares)
    return None
