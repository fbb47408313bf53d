"""GPT dataset: fixed-length samples cut from a shuffled stream of documents.

Three indices, all a pure function of (dataset, split range, num_samples, seq_length, seed):
- document index: the split's sequence ids, each epoch independently permuted, epochs
  concatenated, as many epochs as needed for num_samples;
- sample index: where each sample starts in that stream (C++ builder, see helpers.py);
- shuffle index: a permutation of the samples.
Samples are seq_length + 1 tokens (inputs and shifted labels) and may span documents.
"""

from __future__ import annotations

import os
from typing import Dict, Optional

import numpy as np
import torch

from .helpers import build_sample_idx
from .index_cache import IndexCache
from .indexed_dataset import IndexedDataset, IndexedDatasetError
from .masks import ltor_fields

_INDEX_FORMAT_VERSION = 1  # bump when the index semantics change so old caches are ignored


class GPTDataset(torch.utils.data.Dataset):
    def __init__(
        self,
        indexed: IndexedDataset,
        sequence_ids: np.ndarray,
        num_samples: int,
        seq_length: int,
        seed: int,
        split: str,
        eod: int,
        vocab_size: Optional[int] = None,
        eod_mask_loss: bool = False,
        reset_position_ids: bool = False,
        reset_attention_mask: bool = False,
        cache_dir: Optional[str] = None,
    ):
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        self.indexed = indexed
        self.sequence_ids = np.asarray(sequence_ids, dtype=np.int64)
        self.num_samples = int(num_samples)
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.split = split
        self.eod = int(eod)
        self.vocab_size = vocab_size
        self.eod_mask_loss = eod_mask_loss
        self.reset_position_ids = reset_position_ids
        self.reset_attention_mask = reset_attention_mask
        self.tokens_per_epoch = int(indexed.sequence_lengths[self.sequence_ids].astype(np.int64).sum())
        if self.tokens_per_epoch == 0 and self.num_samples > 0:
            raise ValueError(f"{indexed.path_prefix}: the {split} split has no tokens; "
                             f"{self.num_samples} samples were requested")

        arrays = None
        cache = None
        if cache_dir is not None:
            cache = IndexCache(cache_dir, self._description(), ("doc_idx", "sample_idx", "shuffle_idx"),
                               label=f"GPTDataset-{split}")
            arrays = cache.load()
        if arrays is None:
            arrays = self._build_indices()
            if cache is not None:
                cache.save(arrays)
        self.doc_idx = arrays["doc_idx"]
        self.sample_idx = arrays["sample_idx"]
        self.shuffle_idx = arrays["shuffle_idx"]

    def _description(self) -> Dict:
        prefix = self.indexed.path_prefix
        return {
            "class": "GPTDataset",
            "format": _INDEX_FORMAT_VERSION,
            "path_prefix": os.path.realpath(prefix),
            "idx_bytes": os.path.getsize(self.indexed.idx_path),
            "bin_bytes": os.path.getsize(self.indexed.bin_path),
            "split": self.split,
            "sequence_range": [int(self.sequence_ids[0]), int(self.sequence_ids[-1]), int(self.sequence_ids.size)]
            if self.sequence_ids.size else [],
            "num_samples": self.num_samples,
            "seq_length": self.seq_length,
            "seed": self.seed,
        }

    def _num_epochs(self) -> int:
        needed_tokens = self.num_samples * self.seq_length + 1
        return max(1, -(-needed_tokens // self.tokens_per_epoch))

    def _build_indices(self) -> Dict[str, np.ndarray]:
        rng = np.random.RandomState(self.seed)
        num_epochs = self._num_epochs()
        doc_idx = np.concatenate([rng.permutation(self.sequence_ids) for _ in range(num_epochs)])
        total_samples = (num_epochs * self.tokens_per_epoch - 1) // self.seq_length
        sample_idx = build_sample_idx(self.indexed.sequence_lengths, doc_idx, self.seq_length, total_samples)
        shuffle_idx = rng.permutation(total_samples).astype(np.int64)
        return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}

    def __len__(self) -> int:
        return int(self.shuffle_idx.shape[0])

    def sample_tokens(self, idx: int) -> np.ndarray:
        """The seq_length + 1 tokens of sample idx (before the input/label shift)."""
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range [0, {len(self)}) in the {self.split} split "
                             f"of {self.indexed.path_prefix}")
        i = int(self.shuffle_idx[idx])
        first_doc, first_off = (int(x) for x in self.sample_idx[i])
        last_doc, last_off = (int(x) for x in self.sample_idx[i + 1])
        ds = self.indexed
        if first_doc == last_doc:
            parts = [ds.get(int(self.doc_idx[first_doc]), first_off, last_off - first_off + 1)]
        else:
            parts = [ds.get(int(self.doc_idx[first_doc]), first_off)]
            parts += [ds.get(int(self.doc_idx[j])) for j in range(first_doc + 1, last_doc)]
            parts.append(ds.get(int(self.doc_idx[last_doc]), 0, last_off + 1))
        tokens = np.concatenate(parts) if len(parts) > 1 else parts[0]
        assert tokens.shape[0] == self.seq_length + 1, "sample index inconsistent with sequence lengths"
        return tokens

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        text = self.sample_tokens(int(idx)).astype(np.int64)
        if self.vocab_size is not None:
            lo, hi = int(text.min()), int(text.max())
            if lo < 0 or hi >= self.vocab_size:
                raise IndexedDatasetError(f"{self.indexed.bin_path}: token id {hi if hi >= self.vocab_size else lo} "
                                 f"outside the tokenizer's vocabulary [0, {self.vocab_size}); "
                                 f"was this dataset preprocessed with a different tokenizer?")
        tokens = text[:-1]
        sample = {"tokens": torch.from_numpy(tokens.copy()), "labels": torch.from_numpy(text[1:].copy())}
        sample.update(ltor_fields(tokens, self.eod, self.eod_mask_loss, self.reset_position_ids,
                                  self.reset_attention_mask))
        return sample
