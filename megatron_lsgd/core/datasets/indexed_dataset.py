"""Megatron-compatible indexed dataset: a `.bin` of raw tokens plus an `.idx` index.

Layout of the `.idx` file (all little-endian), see docs/data.md:

    b"MMIDIDX\\x00\\x00"        9-byte magic
    u64 version = 1
    u8  dtype code               (DTYPE_CODES)
    u64 sequence_count
    u64 document_count           (number of documents + 1)
    i32[sequence_count]          sequence lengths in tokens
    i64[sequence_count]          byte offsets of the sequences in the .bin
    i64[document_count]          document boundaries as sequence indices (starts at 0)

The reader validates the whole index against the `.bin` size when it opens the pair, so
a corrupt or truncated file fails there with the file named, never later with an
out-of-bounds read.
"""

from __future__ import annotations

import os
import struct
from array import array
from typing import BinaryIO, Dict, Iterable, Optional, Type, Union

import numpy as np

from megatron_lsgd.core.output_files import remove_path, write_error, written_or_removed

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence_count, document_count

DTYPE_CODES: Dict[int, Type[np.number]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}


class IndexedDatasetError(ValueError):
    """A .bin/.idx pair that cannot be read safely; the message names the file."""


def dtype_code(dtype: Union[np.dtype, type]) -> int:
    dt = np.dtype(dtype)
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == dt:
            return code
    raise ValueError(f"dtype {dt} has no code in the .idx format; use one of "
                     f"{[np.dtype(d).name for d in DTYPE_CODES.values()]}")


def optimal_token_dtype(vocab_size: Optional[int]) -> Type[np.number]:
    """Megatron's rule: uint16 while every token id fits with room for padding, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def _strip_suffix(path_prefix: str) -> str:
    # Users often pass "foo.bin" or "foo.idx" where a prefix is expected.
    for suffix in (".bin", ".idx"):
        if path_prefix.endswith(suffix):
            return path_prefix[: -len(suffix)]
    return path_prefix


class _Index:
    """Parsed and validated .idx file; arrays are views into a read-only memmap."""

    def __init__(self, idx_path: str, bin_size: int, bin_path: str):
        self.path = idx_path
        file_size = os.path.getsize(idx_path)
        if file_size < _HEADER.size:
            raise IndexedDatasetError(
                f"{idx_path}: truncated index: {file_size} bytes, the header alone needs {_HEADER.size}")
        with open(idx_path, "rb") as f:
            magic, version, code, seq_count, doc_count = _HEADER.unpack(f.read(_HEADER.size))
        if magic != _MAGIC:
            raise IndexedDatasetError(
                f"{idx_path}: bad magic {magic!r}, expected {_MAGIC!r} (not a Megatron mmap .idx file)")
        if version != _VERSION:
            raise IndexedDatasetError(f"{idx_path}: unsupported index version {version}, expected {_VERSION}")
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(
                f"{idx_path}: unknown dtype code {code}, expected one of {sorted(DTYPE_CODES)}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = _HEADER.size + seq_count * 4 + seq_count * 8 + doc_count * 8
        if file_size < expected:
            raise IndexedDatasetError(
                f"{idx_path}: truncated index: {file_size} bytes, header declares "
                f"{seq_count} sequences and {doc_count} document entries ({expected} bytes)")
        if doc_count < 1:
            raise IndexedDatasetError(f"{idx_path}: document_count is 0, expected at least the leading 0 entry")

        self._mmap = np.memmap(idx_path, mode="r", dtype=np.uint8)
        off = _HEADER.size
        self.sequence_lengths = np.frombuffer(self._mmap, dtype="<i4", count=seq_count, offset=off)
        off += seq_count * 4
        self.sequence_pointers = np.frombuffer(self._mmap, dtype="<i8", count=seq_count, offset=off)
        off += seq_count * 8
        self.document_indices = np.frombuffer(self._mmap, dtype="<i8", count=doc_count, offset=off)
        self._validate(bin_size, bin_path)

    def _validate(self, bin_size: int, bin_path: str) -> None:
        lengths, pointers, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        itemsize = self.dtype.itemsize
        if lengths.size and lengths.min() < 0:
            bad = int(np.argmax(lengths < 0))
            raise IndexedDatasetError(f"{self.path}: sequence {bad} has negative length {int(lengths[bad])}")
        # Chunked so validating a huge index does not allocate index-sized temporaries.
        chunk = 1 << 22
        covered = 0  # the end of the furthest sequence
        for start in range(0, pointers.size, chunk):
            ptr = pointers[start:start + chunk]
            ends = ptr + lengths[start:start + chunk].astype(np.int64) * itemsize
            covered = max(covered, int(ends.max()) if ends.size else 0)
            bad_mask = (ptr < 0) | (ends > bin_size)
            if bad_mask.any():
                bad = int(np.argmax(bad_mask))
                raise IndexedDatasetError(
                    f"{self.path}: sequence {start + bad} spans bytes [{int(ptr[bad])}, {int(ends[bad])}) "
                    f"but {bin_path} has only {bin_size} bytes (truncated .bin or corrupt index)")
        if covered < bin_size:  # an index written for another (smaller) dataset would read a prefix only
            raise IndexedDatasetError(
                f"{self.path} describes {covered} bytes of tokens but {bin_path} has {bin_size}: the two files do "
                f"not belong together (an .idx from another dataset, or a .bin written to after its index); "
                f"write them again with tools/preprocess_data.py")
        if docs[0] != 0:
            raise IndexedDatasetError(f"{self.path}: document indices must start at 0, found {int(docs[0])}")
        if docs.size > 1 and (np.diff(docs) < 0).any():
            raise IndexedDatasetError(f"{self.path}: document indices are not non-decreasing")
        if docs[-1] > lengths.size:
            raise IndexedDatasetError(
                f"{self.path}: document index {int(docs[-1])} is past the {lengths.size} sequences")

    def close(self) -> None:
        # Drop the views before the memmap so the file can be unlinked on every platform.
        self.sequence_lengths = self.sequence_pointers = self.document_indices = None  # type: ignore[assignment]
        self._mmap = None  # type: ignore[assignment]


class IndexedDataset:
    """Read-only, memory-mapped view of a `.bin/.idx` pair (`mmap=False`: the .bin is read
    into memory instead, Megatron's --no-mmap-bin-files).

    `ds[i]` is sequence i as a numpy array; `ds.get(i, offset, length)` a slice of it
    (what the GPT dataset uses to cut samples that straddle sequences).
    """

    def __init__(self, path_prefix: str, mmap: bool = True):
        self.path_prefix = _strip_suffix(path_prefix)
        self.mmap = mmap
        self.idx_path = index_file_path(self.path_prefix)
        self.bin_path = data_file_path(self.path_prefix)
        for p in (self.idx_path, self.bin_path):
            if not os.path.isfile(p):
                raise FileNotFoundError(f"indexed dataset file not found: {p} "
                                        f"(prefix {self.path_prefix!r} needs both .bin and .idx)")
        bin_size = os.path.getsize(self.bin_path)
        self.index = _Index(self.idx_path, bin_size, self.bin_path)
        # np.memmap refuses empty files; an empty dataset simply has no token buffer.
        if not bin_size:
            self._bin = np.zeros(0, dtype=np.uint8)
        elif mmap:
            self._bin = np.memmap(self.bin_path, mode="r", dtype=np.uint8)
        else:
            self._bin = np.fromfile(self.bin_path, dtype=np.uint8)

    # Pickle by path (DataLoader workers under spawn): reopen instead of copying the buffers.
    def __getstate__(self) -> dict:
        return {"path_prefix": self.path_prefix, "mmap": self.mmap}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path_prefix"], state.get("mmap", True))

    @property
    def dtype(self) -> np.dtype:
        return self.index.dtype

    @property
    def sequence_lengths(self) -> np.ndarray:
        return self.index.sequence_lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        return self.index.sequence_pointers

    @property
    def document_indices(self) -> np.ndarray:
        return self.index.document_indices

    @property
    def num_documents(self) -> int:
        return int(self.index.document_indices.size - 1)

    def __len__(self) -> int:
        return int(self.index.sequence_lengths.size)

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"{self.path_prefix}: sequence {idx} out of range [0, {n})")
        idx = idx % n
        seq_len = int(self.index.sequence_lengths[idx])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(f"{self.path_prefix}: slice [{offset}, {offset + length}) outside sequence "
                             f"{idx} of length {seq_len}")
        start = int(self.index.sequence_pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start)

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)

    def close(self) -> None:
        self.index.close()
        self._bin = None  # type: ignore[assignment]


def exists(path_prefix: str) -> bool:
    prefix = _strip_suffix(path_prefix)
    return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))


class IndexedDatasetBuilder:
    """Streams tokens to `{prefix}.bin` and writes `{prefix}.idx` on `finalize()`.

    Each `add_document` call is one sequence and one document (what preprocessing writes);
    `add_item` + `end_document` build multi-sequence documents. Both files are written under
    temporary names and renamed by `finalize()`, so an existing pair is untouched until the
    new one is complete, and `abort()` (or a crash) leaves it as it was.
    """

    def __init__(self, bin_path: str, dtype: Union[np.dtype, type] = np.int32):
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        self.bin_path = bin_path
        self._tmp_bin = f"{bin_path}.tmp.{os.getpid()}"
        self._file: BinaryIO = open(self._tmp_bin, "wb")
        self._lengths = array("q")
        self._doc_idx = array("q", [0])
        if np.issubdtype(self.dtype, np.integer):
            info = np.iinfo(self.dtype)
            self._range: Optional[tuple] = (int(info.min), int(info.max))
        else:
            self._range = None

    def add_item(self, tokens: Iterable) -> None:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            arr = arr.reshape(-1)
        if self._range is not None and arr.size and np.issubdtype(arr.dtype, np.integer):
            lo, hi = int(arr.min()), int(arr.max())
            if lo < self._range[0] or hi > self._range[1]:
                raise ValueError(f"{self.bin_path}: token ids [{lo}, {hi}] do not fit dtype {self.dtype.name}; "
                                 f"the tokenizer's vocabulary is too large for this dataset dtype")
        if arr.size >= 2**31:
            raise ValueError(f"{self.bin_path}: a sequence of {arr.size} tokens exceeds the int32 length field")
        self._write(arr.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.append(int(arr.size))

    def _write(self, data: bytes) -> None:
        try:
            self._file.write(data)
        except OSError as err:  # a full disk: the message names the output, not its temporary name
            raise write_error(err, self.bin_path) from None

    def end_document(self) -> None:
        self._doc_idx.append(len(self._lengths))

    def add_document(self, tokens: Iterable) -> None:
        self.add_item(tokens)
        self.end_document()

    def add_index(self, path_prefix: str) -> None:
        """Append a whole existing dataset (merge): copy its .bin, shift its document indices."""
        other = IndexedDataset(path_prefix)
        try:
            if other.dtype != self.dtype:
                raise ValueError(f"{other.idx_path}: dtype {other.dtype.name} differs from the output's "
                                 f"{self.dtype.name}; merge datasets written with the same tokenizer")
            base = len(self._lengths)
            self._lengths.extend(int(x) for x in other.sequence_lengths)
            self._doc_idx.extend(int(x) + base for x in other.document_indices[1:])
            # Only the bytes the index refers to are copied, in order, so pointers stay dense.
            lengths = other.sequence_lengths
            pointers = other.sequence_pointers
            contiguous = bool(np.all(pointers[1:] == pointers[:-1] + lengths[:-1].astype(np.int64)
                                     * self.dtype.itemsize)) if len(other) else True
            if contiguous and len(other) and pointers[0] == 0:
                end = int(pointers[-1]) + int(lengths[-1]) * self.dtype.itemsize
                with open(other.bin_path, "rb") as src:
                    remaining = end
                    while remaining:
                        chunk = src.read(min(remaining, 1 << 24))
                        self._write(chunk)
                        remaining -= len(chunk)
            else:
                for i in range(len(other)):
                    self._write(other.get(i).tobytes())
        finally:
            other.close()

    def abort(self) -> None:
        """Close and delete the partial output (on error before finalize). Closing flushes
        the buffer, which fails again on a full disk: the file is removed all the same."""
        try:
            self._file.close()
        except OSError:
            pass
        remove_path(self._tmp_bin)

    def finalize(self, idx_path: str) -> None:
        with written_or_removed(self._tmp_bin, report_as=self.bin_path):
            self._file.close()
        tmp_idx = f"{idx_path}.tmp.{os.getpid()}"
        lengths = np.frombuffer(self._lengths, dtype=np.int64) if len(self._lengths) else np.zeros(0, np.int64)
        pointers = np.zeros(lengths.size, dtype="<i8")
        if lengths.size > 1:
            np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.frombuffer(self._doc_idx, dtype=np.int64)
        try:
            with written_or_removed(tmp_idx, report_as=idx_path):
                with open(tmp_idx, "wb") as f:
                    f.write(_HEADER.pack(_MAGIC, _VERSION, self._code, lengths.size, doc_idx.size))
                    f.write(lengths.astype("<i4").tobytes())
                    f.write(pointers.tobytes())
                    f.write(doc_idx.astype("<i8").tobytes())
        except BaseException:
            remove_path(self._tmp_bin)
            raise
        # .bin first: a reader between the two renames sees the new .bin with the old .idx,
        # which the index check (sizes against the .bin) refuses loudly.
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(tmp_idx, idx_path)

