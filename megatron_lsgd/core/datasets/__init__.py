"""Data pipeline: Megatron .bin/.idx datasets, GPT samples, blending, mock data."""

from __future__ import annotations

from .blended_dataset import BlendedDataset
from .builder import build_train_valid_test_datasets, data_passes, parse_data_path, parse_split, split_ranges
from .config import DataConfig
from .gpt_dataset import GPTDataset
from .indexed_dataset import (DTYPE_CODES, IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError,
                              optimal_token_dtype)
from .mock_dataset import MockGPTDataset

__all__ = [
    "BlendedDataset", "DTYPE_CODES", "DataConfig", "GPTDataset", "IndexedDataset", "IndexedDatasetBuilder",
    "IndexedDatasetError", "MockGPTDataset", "build_train_valid_test_datasets", "data_passes", "optimal_token_dtype",
    "parse_data_path", "parse_split", "split_ranges",
]
