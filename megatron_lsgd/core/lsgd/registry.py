"""Name -> synchronizer class. Algorithms register themselves (`@register`); `catalog.py`
imports every module of `algorithms/`, so every built-in one registers. This module imports
only the protocol, so the protocol, the registry and the algorithms read top-down with no
import circle."""

from __future__ import annotations

from typing import Dict, List

from megatron_lsgd.core.lsgd.protocol import Synchronizer

_REGISTRY: Dict[str, type] = {}


def register(cls: type) -> type:
    if not (isinstance(cls, type) and issubclass(cls, Synchronizer)) or not cls.name:
        raise ValueError(f"{cls!r} must be a Synchronizer subclass with a `name`")
    if cls.name in _REGISTRY:
        raise ValueError(f"synchronizer {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def registered_algorithms() -> List[str]:
    return sorted(_REGISTRY)


def synchronizer_class(name: str) -> type:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"--lsgd-algorithm {name!r}: choose one of {', '.join(registered_algorithms())}") from None
