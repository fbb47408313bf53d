"""Checkpoints: Megatron's directory layout, per-rank torch files loaded with
weights_only=True, atomic commit. See docs/checkpointing.md."""

from megatron_lsgd.training.checkpointing.config import CheckpointConfig
from megatron_lsgd.training.checkpointing.errors import CheckpointError

__all__ = ["CheckpointConfig", "CheckpointError"]
