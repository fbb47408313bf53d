"""Typed configuration of the data path (built from argparse in training/arguments.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class DataConfig:
    # Megatron's --data-path: either [prefix, ...] or [weight, prefix, weight, prefix, ...].
    data_path: List[str] = field(default_factory=list)
    split: str = "969,30,1"
    data_cache_path: Optional[str] = None
    mock_data: bool = False
    seq_length: int = 1024
    seed: int = 1234
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    num_workers: int = 0
    mmap_bin_files: bool = True  # False (--no-mmap-bin-files): read each .bin into memory

    def validate(self) -> None:
        if not self.mock_data and not self.data_path:
            raise ValueError("--data-path is required unless --mock-data is given")
        if self.mock_data and self.data_path:  # one of them would be ignored silently
            raise ValueError("--mock-data and --data-path exclude each other: --mock-data trains on random tokens, "
                             "--data-path on your files; give one of them")
        parts = self.split.replace("/", ",").split(",")
        try:
            weights = [float(p) for p in parts]
        except ValueError:
            raise ValueError(f"--split {self.split!r}: expected numbers such as 949,50,1") from None
        if len(weights) > 3 or not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"--split {self.split!r}: up to three non-negative weights with a positive sum")
        if weights[0] == 0:
            raise ValueError(f"--split {self.split} gives the training set no data; give the first weight a share "
                             f"(e.g. 969,30,1)")
        if self.num_workers < 0:
            raise ValueError("--num-workers must be >= 0")
