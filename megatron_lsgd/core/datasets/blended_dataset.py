"""Weighted blend of datasets: sample i comes from dataset_index[i], item dataset_sample_index[i]."""

from __future__ import annotations

from typing import Dict, Sequence

import numpy as np
import torch

from .helpers import build_blending_indices


def normalize_weights(weights: Sequence[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0 or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"blend weights must be non-negative with a positive sum, got {list(weights)}")
    return w / w.sum()


class BlendedDataset(torch.utils.data.Dataset):
    def __init__(self, datasets: Sequence[torch.utils.data.Dataset], weights: Sequence[float], size: int):
        if len(datasets) != len(weights):
            raise ValueError("BlendedDataset: one weight per dataset")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights)
        self.size = int(size)
        self.dataset_index, self.dataset_sample_index = build_blending_indices(self.weights, self.size)
        counts = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for d, (count, ds) in enumerate(zip(counts, self.datasets)):
            if count and (ds is None or len(ds) < count):
                raise ValueError(f"BlendedDataset: dataset {d} needs {count} samples but has "
                                 f"{0 if ds is None else len(ds)}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range [0, {self.size})")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]
