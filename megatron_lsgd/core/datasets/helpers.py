"""Index builders: the C++ versions (megatron_lsgd._C) and a pure-Python reference.

The dataset code calls `build_sample_idx` / `build_blending_indices`, which use the
compiled extension. The `*_py` functions define the exact semantics; the tests check that
both agree on random inputs, and the benchmark compares their speed.
"""

from __future__ import annotations

from typing import Tuple

import numpy as np


def _native():
    try:
        from megatron_lsgd import _C  # noqa: PLC0415 - the extension is optional at import time
    except ImportError as exc:
        # OSError: a file the run needs is missing, so the run stops with one `error:` line
        raise OSError("megatron_lsgd._C (the compiled index builders that --data-path needs) is not built; run "
                      "`pip install -e .` or `python setup.py build_ext --inplace` in the repository root") from exc
    return _C


def native_available() -> bool:
    try:
        _native()
    except OSError:
        return False
    return True


def build_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_samples: int) -> np.ndarray:
    """int64 [num_samples + 1, 2]: row i is (position in doc_idx, token offset) where sample i
    starts; sample i spans to row i + 1 inclusive (seq_length + 1 tokens)."""
    return _native().build_sample_idx(np.ascontiguousarray(sizes, dtype=np.int32),
                                      np.ascontiguousarray(doc_idx, dtype=np.int64),
                                      int(seq_length), int(num_samples))


def build_blending_indices(weights: np.ndarray, size: int) -> Tuple[np.ndarray, np.ndarray]:
    """(dataset_index int32[size], dataset_sample_index int64[size]) for a weighted blend."""
    return _native().build_blending_indices(np.ascontiguousarray(weights, dtype=np.float64), int(size))


def build_sample_idx_py(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_samples: int) -> np.ndarray:
    """Reference for build_sample_idx (same output, same errors as ValueError)."""
    if seq_length < 1:
        raise ValueError("build_sample_idx: seq_length must be >= 1")
    if num_samples < 0:
        raise ValueError("build_sample_idx: num_samples must be >= 0")
    sizes = np.asarray(sizes).tolist()
    doc_idx = np.asarray(doc_idx).tolist()
    n_sizes, n_docs = len(sizes), len(doc_idx)
    out = np.zeros((num_samples + 1, 2), dtype=np.int64)
    doc_pos = offset = 0
    for s in range(1, num_samples + 1):
        remaining = seq_length + 1
        while remaining != 0:
            if doc_pos >= n_docs:
                raise ValueError(f"build_sample_idx: document index exhausted after {s - 1} samples; "
                                 f"not enough tokens for {num_samples} samples")
            doc = doc_idx[doc_pos]
            if not 0 <= doc < n_sizes:
                raise ValueError(f"build_sample_idx: doc_idx[{doc_pos}] = {doc} is outside [0, {n_sizes})")
            doc_len = sizes[doc] - offset
            remaining -= doc_len
            if remaining <= 0:
                offset += remaining + doc_len - 1
                remaining = 0
            else:
                doc_pos += 1
                offset = 0
        out[s, 0] = doc_pos
        out[s, 1] = offset
    return out


def build_blending_indices_py(weights: np.ndarray, size: int) -> Tuple[np.ndarray, np.ndarray]:
    """Reference for build_blending_indices."""
    weights = np.asarray(weights, dtype=np.float64)
    if weights.ndim != 1 or weights.size < 1:
        raise ValueError("build_blending_indices: weights must be a non-empty 1-D array")
    if size < 0:
        raise ValueError("build_blending_indices: size must be >= 0")
    if not (weights >= 0).all():
        raise ValueError("build_blending_indices: weights must be >= 0")
    w = weights.tolist()
    counts = [0] * len(w)
    dataset_index = np.zeros(size, dtype=np.int32)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    for i in range(size):
        target = float(i + 1)
        best, best_err = 0, w[0] * target - counts[0]
        for d in range(1, len(w)):
            err = w[d] * target - counts[d]
            if err > best_err:
                best, best_err = d, err
        dataset_index[i] = best
        dataset_sample_index[i] = counts[best]
        counts[best] += 1
    return dataset_index, dataset_sample_index
