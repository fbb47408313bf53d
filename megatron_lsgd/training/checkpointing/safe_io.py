"""Reading and writing checkpoint files without executing code from them.

Files are torch.save archives loaded with `weights_only=True`: only tensors and plain
containers of str/int/float/bool/None come back, never pickled objects. Because a value
that is not of those types would save fine and then fail at load time (possibly months
later), `check_plain` rejects it at save time, naming where it sits.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from megatron_lsgd.training.checkpointing.atomic import fsync_file
from megatron_lsgd.training.checkpointing.errors import CheckpointError

_SCALARS = (str, int, float, bool, type(None))


def check_plain(value: Any, where: str) -> None:
    if isinstance(value, _SCALARS) or isinstance(value, torch.Tensor):
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise CheckpointError(f"{where}: dict key {k!r} is a {type(k).__name__}; use str or int")
            check_plain(v, f"{where}[{k!r}]")
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_plain(v, f"{where}[{i}]")
        return
    raise CheckpointError(
        f"{where} is a {type(value).__module__}.{type(value).__name__}; checkpoints hold only tensors, "
        f"str/int/float/bool/None and dicts/lists/tuples of them (loaded with weights_only=True)")


def save_file(obj: Any, path: str, what: str) -> int:
    """torch.save + fsync; returns the size in bytes (recorded in metadata.json)."""
    check_plain(obj, what)
    torch.save(obj, path)
    fsync_file(path)
    return os.path.getsize(path)


def load_file(path: str, expected_size: Optional[int] = None) -> Any:
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint file {path} is missing")
    size = os.path.getsize(path)
    if expected_size is not None and size != expected_size:
        raise CheckpointError(f"checkpoint file {path} is {size} bytes but metadata.json recorded "
                              f"{expected_size}: the file is truncated or was replaced")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several types for corrupt archives
        raise CheckpointError(f"checkpoint file {path} is unreadable ({type(err).__name__}: {err}); "
                              f"it may be truncated or corrupt") from err
