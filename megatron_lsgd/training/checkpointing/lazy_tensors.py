"""Tensors made when asked for, from source files opened only while they are needed.

tools/checkpoint/convert.py streams: a loader describes the model (and optimizer state) as
`LazyTensors`, whose names and shapes are known up front but whose values are read from
the source only when a saver asks for one; the saver writes one target file at a time and
then calls `release()`, which closes every source file opened for it. So the host holds
one target file (a TP x PP slot's model or optimizer state, or one Hugging Face shard) and
the source pages it was made from, never the model.

Source files are opened memory-mapped (`torch.load(mmap=True)`, safetensors' `safe_open`):
opening reads only the file's index; a tensor's pages are read when a value is taken from
it, and leave the process's memory when the file is released (every tensor kept across a
release is a copy, see `detached`). Files are also released once `SOURCE_BYTES` have been
read through them (`OpenFiles.settle`, between two tensors), so the source pages held
stay below that however large the target file.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch

Shape = Tuple[int, ...]

# Source bytes read through open files before they are released and opened again (a
# reopening costs the file's index, not its data).
SOURCE_BYTES = 64 << 20


class LazyTensors(Mapping):
    """name -> tensor, made by `produce(name)` on every access (nothing is kept); the names,
    in order, and each tensor's shape are known without making any."""

    def __init__(self, shapes: Dict[str, Shape], produce: Callable[[str], torch.Tensor]):
        self._shapes = {name: tuple(shape) for name, shape in shapes.items()}
        self._produce = produce

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._shapes:
            raise KeyError(name)
        return self._produce(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)

    def __contains__(self, name) -> bool:
        return name in self._shapes

    def shape(self, name: str) -> Shape:
        return self._shapes[name]


def shape_of(tensors: Mapping, name: str) -> Shape:
    """A tensor's shape without making it (plain dicts of tensors work too)."""
    return tensors.shape(name) if isinstance(tensors, LazyTensors) else tuple(tensors[name].shape)


def numel_of(tensors: Mapping) -> int:
    return sum(math.prod(shape_of(tensors, name)) for name in tensors)


def detached(value: Any) -> Any:
    """A deep copy whose tensors own their storage (a memory-mapped file's storage is
    copied, exactly its bytes, with storages shared inside `value` still shared), so keeping
    it does not keep the file mapped."""
    return copy.deepcopy(value)


class OpenFiles:
    """Source files kept open until `release()`: torch files memory-mapped (checked against
    their recorded size each time and their SHA-256 the first time), safetensors files by
    handle; and the last tensor a loader made, which the next access often asks for again
    (Hugging Face's q, k and v come from one fused tensor)."""

    def __init__(self, source_bytes: Optional[int] = None):
        self._torch: Dict[str, Any] = {}
        self._safetensors: Dict[str, Any] = {}
        self._verified = set()
        self._recent: Optional[Tuple[Any, torch.Tensor]] = None
        self._read = 0
        self._source_bytes = SOURCE_BYTES if source_bytes is None else source_bytes
        self.opened = 0  # files opened so far (a test counts them)

    def read(self, nbytes: int) -> None:
        """Count source bytes read through the open files."""
        self._read += nbytes

    def settle(self) -> None:
        """Release the open files if `source_bytes` were read through them (called between
        two tensors: what was made from them is a copy or keeps its own pages)."""
        if self._read >= self._source_bytes:
            self.release()

    def torch_file(self, path: str, size: Optional[int] = None, sha256: Optional[str] = None) -> Any:
        from megatron_lsgd.training.checkpointing.safe_io import load_file

        if path not in self._torch:
            self._torch[path] = load_file(path, size, None if path in self._verified else sha256, mmap=True)
            self._verified.add(path)
            self.opened += 1
        return self._torch[path]

    def safetensors_file(self, path: str) -> Any:
        if path not in self._safetensors:
            from safetensors import safe_open
            self._safetensors[path] = safe_open(path, framework="pt")
            self.opened += 1
        return self._safetensors[path]

    def recent(self, key, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        if self._recent is None or self._recent[0] != key:
            self._recent = None  # drop the old one before making the new
            self._recent = (key, make())
        return self._recent[1]

    def release(self) -> None:
        self._recent = None
        self._torch.clear()
        self._safetensors.clear()
        self._read = 0
