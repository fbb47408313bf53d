"""Round trips of the .bin/.idx format and every documented bad input."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from megatron_lsgd.core.datasets.indexed_dataset import (DTYPE_CODES, IndexedDataset, IndexedDatasetBuilder,
                                                         IndexedDatasetError, optimal_token_dtype)

from datatest_utils import write_dataset

HEADER = 9 + 8 + 1 + 8 + 8


@pytest.mark.parametrize("code", sorted(DTYPE_CODES))
def test_round_trip_every_dtype(tmp_path, code):
    dtype = np.dtype(DTYPE_CODES[code])
    rng = np.random.default_rng(code)
    docs = [rng.integers(0, 100, size=n).astype(dtype) for n in (5, 0, 17, 1)]
    prefix = write_dataset(str(tmp_path / "ds"), docs, dtype)
    with open(prefix + ".idx", "rb") as f:
        head = f.read(HEADER)
    magic, version, stored_code, seqs, docs_count = struct.unpack("<9sQBQQ", head)
    assert (magic, version, stored_code, seqs, docs_count) == (b"MMIDIDX\x00\x00", 1, code, 4, 5)
    ds = IndexedDataset(prefix)
    assert ds.dtype == dtype and len(ds) == 4 and ds.num_documents == 4
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds[i], doc)
    assert ds.sequence_lengths.tolist() == [5, 0, 17, 1]
    assert ds.sequence_pointers.tolist() == [0, 5 * dtype.itemsize, 5 * dtype.itemsize, 22 * dtype.itemsize]
    assert ds.document_indices.tolist() == [0, 1, 2, 3, 4]
    assert os.path.getsize(prefix + ".bin") == 23 * dtype.itemsize


def test_byte_layout_matches_megatron(tmp_path):
    """Byte-for-byte: the index a Megatron builder writes for two uint16 documents."""
    prefix = write_dataset(str(tmp_path / "ds"), [[1, 2, 3], [7]], np.uint16)
    expected = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8) + struct.pack("<QQ", 2, 3)
                + struct.pack("<2i", 3, 1) + struct.pack("<2q", 0, 6) + struct.pack("<3q", 0, 1, 2))
    assert open(prefix + ".idx", "rb").read() == expected
    assert open(prefix + ".bin", "rb").read() == struct.pack("<4H", 1, 2, 3, 7)


def test_multi_sequence_documents_and_slices(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "ds.bin"), np.int32)
    builder.add_item([1, 2, 3])
    builder.add_item([4, 5])
    builder.end_document()
    builder.add_document([6])
    builder.finalize(str(tmp_path / "ds.idx"))
    ds = IndexedDataset(str(tmp_path / "ds.bin"))  # a .bin path is accepted as prefix
    assert ds.document_indices.tolist() == [0, 2, 3]
    assert ds.get(0, 1, 2).tolist() == [2, 3]
    assert ds.get(1, 1).tolist() == [5]
    with pytest.raises(IndexError, match="outside sequence 1"):
        ds.get(1, 1, 2)
    with pytest.raises(IndexError, match="out of range"):
        ds.get(3)


def test_empty_dataset(tmp_path):
    prefix = write_dataset(str(tmp_path / "empty"), [])
    ds = IndexedDataset(prefix)
    assert len(ds) == 0 and ds.num_documents == 0


def test_optimal_dtype():
    assert optimal_token_dtype(8197) == np.uint16
    assert optimal_token_dtype(65499) == np.uint16
    assert optimal_token_dtype(65500) == np.int32
    assert optimal_token_dtype(128256) == np.int32


def test_builder_rejects_tokens_outside_dtype(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "ds.bin"), np.uint16)
    with pytest.raises(ValueError, match=r"ds.bin: token ids \[0, 70000\] do not fit dtype uint16"):
        builder.add_document([0, 70000])


def test_merge_with_add_index(tmp_path):
    a = write_dataset(str(tmp_path / "a"), [[1, 2], [3]])
    b = write_dataset(str(tmp_path / "b"), [[4, 5, 6]])
    builder = IndexedDatasetBuilder(str(tmp_path / "m.bin"), np.uint16)
    builder.add_index(a)
    builder.add_index(b)
    builder.finalize(str(tmp_path / "m.idx"))
    merged = IndexedDataset(str(tmp_path / "m"))
    assert [merged[i].tolist() for i in range(len(merged))] == [[1, 2], [3], [4, 5, 6]]
    assert merged.document_indices.tolist() == [0, 1, 2, 3]
    c = write_dataset(str(tmp_path / "c"), [[1]], np.int32)
    with pytest.raises(ValueError, match="c.idx: dtype int32 differs"):
        IndexedDatasetBuilder(str(tmp_path / "n.bin"), np.uint16).add_index(c)


# ---- bad inputs: each names the file, nothing is read out of bounds ------------------------

@pytest.fixture
def good(tmp_path):
    return write_dataset(str(tmp_path / "good"), [[1, 2, 3], [4, 5], [6]])


def _patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_missing_files(good):
    os.unlink(good + ".bin")
    with pytest.raises(FileNotFoundError, match="good.bin"):
        IndexedDataset(good)
    with pytest.raises(FileNotFoundError, match="nothere.idx"):
        IndexedDataset(os.path.join(os.path.dirname(good), "nothere"))


def test_bad_magic(good):
    _patch(good + ".idx", 0, b"XXXXXXX")
    with pytest.raises(IndexedDatasetError, match=r"good.idx: bad magic"):
        IndexedDataset(good)


def test_wrong_version(good):
    _patch(good + ".idx", 9, struct.pack("<Q", 2))
    with pytest.raises(IndexedDatasetError, match=r"good.idx: unsupported index version 2"):
        IndexedDataset(good)


@pytest.mark.parametrize("code", [0, 9, 255])
def test_unknown_dtype(good, code):
    _patch(good + ".idx", 17, bytes([code]))
    with pytest.raises(IndexedDatasetError, match=rf"good.idx: unknown dtype code {code}"):
        IndexedDataset(good)


@pytest.mark.parametrize("keep", [0, 10, HEADER - 1, HEADER + 4, HEADER + 3 * 4 + 3 * 8 + 8])
def test_truncated_index(good, keep):
    with open(good + ".idx", "r+b") as f:
        f.truncate(keep)
    with pytest.raises(IndexedDatasetError, match=r"good.idx: truncated index"):
        IndexedDataset(good)


def test_truncated_bin(good):
    with open(good + ".bin", "r+b") as f:
        f.truncate(9)  # 6 tokens * 2 bytes = 12 expected
    with pytest.raises(IndexedDatasetError, match=r"good.idx: sequence 1 spans bytes \[6, 10\).*good.bin has only 9"):
        IndexedDataset(good)


def test_pointer_past_end(good):
    _patch(good + ".idx", HEADER + 3 * 4 + 8, struct.pack("<q", 1 << 40))
    with pytest.raises(IndexedDatasetError, match=r"good.idx: sequence 1 spans bytes"):
        IndexedDataset(good)


def test_negative_pointer(good):
    _patch(good + ".idx", HEADER + 3 * 4, struct.pack("<q", -4))
    with pytest.raises(IndexedDatasetError, match=r"sequence 0 spans bytes \[-4"):
        IndexedDataset(good)


def test_negative_length(good):
    _patch(good + ".idx", HEADER + 4, struct.pack("<i", -1))
    with pytest.raises(IndexedDatasetError, match=r"good.idx: sequence 1 has negative length -1"):
        IndexedDataset(good)


def test_huge_sequence_count(good):
    _patch(good + ".idx", 18, struct.pack("<Q", 1 << 60))
    with pytest.raises(IndexedDatasetError, match=r"good.idx: truncated index"):
        IndexedDataset(good)


def test_bad_document_indices(good):
    doc_off = HEADER + 3 * 4 + 3 * 8
    _patch(good + ".idx", doc_off + 3 * 8, struct.pack("<q", 99))
    with pytest.raises(IndexedDatasetError, match=r"good.idx: document index 99 is past the 3 sequences"):
        IndexedDataset(good)
    _patch(good + ".idx", doc_off + 3 * 8, struct.pack("<q", 3))
    _patch(good + ".idx", doc_off + 8, struct.pack("<q", 2))  # [0, 2, 2, 3] -> [0, 2, 1, 3]
    _patch(good + ".idx", doc_off + 16, struct.pack("<q", 1))
    with pytest.raises(IndexedDatasetError, match=r"good.idx: document indices are not non-decreasing"):
        IndexedDataset(good)
    _patch(good + ".idx", doc_off, struct.pack("<q", 1))
    with pytest.raises(IndexedDatasetError, match=r"good.idx: document indices must start at 0"):
        IndexedDataset(good)
