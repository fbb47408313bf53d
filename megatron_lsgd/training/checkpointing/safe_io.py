"""Reading and writing checkpoint files without executing code from them.

Files are torch.save archives loaded with `weights_only=True`: only tensors and plain
containers of str/int/float/bool/None come back, never pickled objects. Because a value
that is not of those types would save fine and then fail at load time (possibly months
later), `check_plain` rejects it at save time, naming where it sits.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import re
from typing import Any, Optional, Tuple

import torch

from megatron_lsgd.core.output_files import written_or_removed
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


class _HashingWriter:
    """A write-only file wrapper that hashes what passes through (torch.save writes its
    archive sequentially), so the checksum costs no second read of the file."""

    def __init__(self, f):
        self._f = f
        self.sha256 = hashlib.sha256()

    def write(self, data) -> int:
        self.sha256.update(data)
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()


def save_file(obj: Any, path: str, what: str) -> Tuple[int, str]:
    """torch.save + fsync; returns (size in bytes, sha256 hex digest), both recorded in
    metadata.json and checked on load."""
    check_plain(obj, what)
    with written_or_removed(path):  # torch's zip writer hides a full disk's OSError: unmasked here
        with open(path, "wb") as f:
            writer = _HashingWriter(f)
            torch.save(obj, writer)
            f.flush()
            os.fsync(f.fileno())
    return os.path.getsize(path), writer.sha256.hexdigest()


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


_UNSUPPORTED_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


def load_file(path: str, expected_size: Optional[int] = None, expected_sha256: Optional[str] = None,
              mmap: bool = False) -> Any:
    """Load one checkpoint file, checking its size and (when recorded) its checksum first.
    `mmap`: the tensors are views of the memory-mapped file, read when used (convert.py)."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint file {path} is missing")
    size = os.path.getsize(path)
    if expected_size is not None and size != expected_size:
        raise CheckpointError(f"checkpoint file {path} is {size} bytes but metadata.json recorded "
                              f"{expected_size}: the file is truncated or was replaced")
    if expected_sha256 is not None:
        found = file_sha256(path)
        if found != expected_sha256:
            raise CheckpointError(
                f"checkpoint file {path} does not match the checksum metadata.json recorded when it was saved "
                f"(sha256 {expected_sha256[:16]}..., found {found[:16]}...): it was modified or corrupted since. "
                f"Restore it, or load an earlier iteration; --no-verify-checkpoint-checksums skips this check")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:  # weights_only refused a pickled object: not ours
        found = _UNSUPPORTED_GLOBAL.search(str(err))
        what = f" ({found.group(1)})" if found else ""
        raise CheckpointError(
            f"checkpoint file {path} is not a valid checkpoint: it holds a pickled Python object{what}. "
            f"Checkpoints hold only tensors and plain values, and nothing else is ever loaded, because "
            f"unpickling an object can run arbitrary code") from None
    except Exception as err:  # torch raises several types for corrupt archives
        raise CheckpointError(f"checkpoint file {path} is unreadable ({type(err).__name__}: {err}); "
                              f"it may be truncated or corrupt") from err
