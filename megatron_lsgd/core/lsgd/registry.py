"""Importing this module registers every built-in synchronizer."""

from megatron_lsgd.core.lsgd import sync  # noqa: F401  (registers "sync")
from megatron_lsgd.core.lsgd.base import registered_algorithms, synchronizer_class

__all__ = ["registered_algorithms", "synchronizer_class"]
