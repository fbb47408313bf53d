"""Checkpoint flags as a typed config (built in training/arguments.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class CheckpointConfig:
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    no_save_optim: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False  # load the model only, start at iteration 0 with fresh optimizer and RNG
    verify_checksums: bool = True  # compare every loaded file with the sha256 in metadata.json

    @property
    def load_optim(self) -> bool:
        return not (self.no_load_optim or self.finetune)

    @property
    def load_rng(self) -> bool:
        return not (self.no_load_rng or self.finetune)

    def validate(self) -> None:
        if self.save_interval is not None:
            if self.save_interval < 1:
                raise ValueError("--save-interval must be >= 1")
            if not self.save:
                raise ValueError("--save-interval needs --save DIR")
