"""Checkpoint flags, each declared once on its field (a typed option group, read by training/arguments.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from megatron_lsgd.core.options import OptionGroup, option


@dataclass
class CheckpointConfig(OptionGroup):
    """Each field declares its flag here once (the command line's checkpointing group)."""

    title: ClassVar[str] = "checkpointing (docs/checkpointing.md)"

    save: Optional[str] = option("--save", None, help="directory to save checkpoints to")
    load: Optional[str] = option("--load", None,
                                 help="directory to resume from (its latest_checkpointed_iteration.txt); may equal "
                                      "--save")
    save_interval: Optional[int] = option("--save-interval", None, type=int, help="iterations between checkpoints")
    no_save_optim: bool = option("--no-save-optim", False, help="save the model and RNG only")
    no_load_optim: bool = option("--no-load-optim", False,
                                 help="do not load optimizer, LR scheduler and synchronizer state")
    no_load_rng: bool = option("--no-load-rng", False, help="do not load RNG states")
    finetune: bool = option("--finetune", False,  # the model only, from iteration 0, fresh optimizer and RNG
                            help="load the model only and start at iteration 0 (fresh optimizer, scheduler, RNG, "
                                 "data)")
    no_verify_checkpoint_checksums: bool = option(
        "--no-verify-checkpoint-checksums", False,
        help="skip comparing every loaded file with the SHA-256 recorded in metadata.json at save time")

    @property
    def verify_checksums(self) -> bool:
        """Compare every loaded file with the sha256 in metadata.json."""
        return not self.no_verify_checkpoint_checksums

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
