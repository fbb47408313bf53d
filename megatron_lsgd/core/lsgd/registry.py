"""Importing this module registers every built-in synchronizer."""

from megatron_lsgd.core.lsgd import diloco, dilocox, sync  # noqa: F401  (register themselves)
from megatron_lsgd.core.lsgd.base import registered_algorithms, synchronizer_class

__all__ = ["registered_algorithms", "synchronizer_class"]
