"""Deterministic synthetic GPT samples for --mock-data (tests, benchmarks, smoke runs)."""

from __future__ import annotations

import numpy as np
import torch


class MockGPTDataset(torch.utils.data.Dataset):
    """Each sample is a pure function of (seed, split, index), so every rank and every
    parallel layout sees exactly the same tokens for the same global sample index.

    Tokens follow a noisy arithmetic progression modulo the vocabulary, so a model can
    learn them and the loss visibly falls in a smoke run.
    """

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int, split: str = "train"):
        if vocab_size < 2:
            raise ValueError("mock data needs a vocabulary of at least 2 tokens")
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed
        self.split_offset = {"train": 0, "valid": 1, "test": 2}[split]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict:
        rng = np.random.default_rng([self.seed, self.split_offset, int(idx)])
        start = int(rng.integers(self.vocab_size))
        stride = int(rng.integers(1, 8))
        base = start + stride * np.arange(self.seq_length + 1)
        noise = rng.random(self.seq_length + 1) < 0.1
        base[noise] += rng.integers(self.vocab_size, size=int(noise.sum()))
        text = torch.from_numpy(base % self.vocab_size).long()
        return {
            "tokens": text[:-1].contiguous(),
            "labels": text[1:].contiguous(),
            "loss_mask": torch.ones(self.seq_length, dtype=torch.float32),
            "position_ids": torch.arange(self.seq_length, dtype=torch.long),
        }
