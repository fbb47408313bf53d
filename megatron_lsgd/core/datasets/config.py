"""Typed configuration of the data path; its flags declared once on its fields (read by training/arguments.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, List, Optional

from megatron_lsgd.core.options import OptionGroup, option


def _own_files_help(what: str) -> str:
    return f"the {what} set's own files, used whole (prefix ... or weight prefix ...); instead of --data-path and --split"



@dataclass
class DataConfig(OptionGroup):
    """Each field with a flag declares it here once (the command line's data group); the
    sequence length and seed come from their own flags."""

    title: ClassVar[str] = "data"

    # Megatron's --data-path: either [prefix, ...] or [weight, prefix, weight, prefix, ...].
    data_path: List[str] = option("--data-path", [], nargs="*", help="prefix ... or weight prefix weight prefix ... "
                                                                     "(blended)")
    split: str = option("--split", "969,30,1",
                        help="train,valid,test shares of each --data-path file (contiguous document ranges)")
    # Megatron's --train-data-path / --valid-data-path / --test-data-path: each split from files of
    # its own, used whole (same syntax as --data-path; --split does not apply)
    train_data_path: List[str] = option("--train-data-path", [], nargs="*", help=_own_files_help("training"))
    valid_data_path: List[str] = option("--valid-data-path", [], nargs="*", help=_own_files_help("validation"))
    test_data_path: List[str] = option("--test-data-path", [], nargs="*",
                                       help=_own_files_help("test") + ": evaluated once at the end of training")
    data_cache_path: Optional[str] = option("--data-cache-path", None)
    mock_data: bool = option("--mock-data", False, help="deterministic synthetic tokens")
    eod_mask_loss: bool = option("--eod-mask-loss", False)
    reset_position_ids: bool = option("--reset-position-ids", False)
    reset_attention_mask: bool = option("--reset-attention-mask", False)
    num_workers: int = option("--num-workers", 0)
    seq_length: int = 1024
    seed: int = 1234
    mmap_bin_files: bool = True  # False (--no-mmap-bin-files): read each .bin into memory

    @property
    def per_split(self) -> bool:
        """Each split has files of its own (--train/valid/test-data-path) instead of --split."""
        return bool(self.train_data_path or self.valid_data_path or self.test_data_path)

    def split_paths(self, split: str) -> List[str]:
        return {"train": self.train_data_path, "valid": self.valid_data_path, "test": self.test_data_path}[split]

    def validate(self, need_train_data: bool = True) -> None:
        """`need_train_data`: False under --skip-train (only held-out sets are read)."""
        per_split = [flag for flag, paths in (("--train-data-path", self.train_data_path),
                                              ("--valid-data-path", self.valid_data_path),
                                              ("--test-data-path", self.test_data_path)) if paths]
        if per_split and self.data_path:  # one of them would be ignored silently
            raise ValueError(f"--data-path and {per_split[0]} exclude each other: --data-path splits its files by "
                             f"--split, {per_split[0]} names one split's files; give one or the other")
        if per_split and self.mock_data:
            raise ValueError(f"--mock-data and {per_split[0]} exclude each other; give one of them")
        if not self.mock_data and not self.data_path and not per_split:
            raise ValueError("--data-path (or --train-data-path) is required unless --mock-data is given")
        if per_split and need_train_data and not self.train_data_path:
            raise ValueError(f"{per_split[0]} is given without --train-data-path: name the training files too "
                             f"(or evaluate only, with --skip-train)")
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
