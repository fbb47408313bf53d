"""The C++ index builders equal the pure-Python reference. These fail (not skip) without
the compiled extension: build it with `python setup.py build_ext --inplace`."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_lsgd.core.datasets import helpers


def test_extension_is_built():
    assert helpers.native_available(), "megatron_lsgd._C missing: run `python setup.py build_ext --inplace`"


@pytest.mark.parametrize("trial", range(20))
def test_sample_idx_matches_reference(trial):
    rng = np.random.default_rng(trial)
    n_seq = int(rng.integers(1, 80))
    sizes = rng.integers(0, 300 if trial % 2 else 8, size=n_seq).astype(np.int32)
    sizes[0] = max(int(sizes[0]), 1)
    epochs = int(rng.integers(1, 4))
    doc_idx = np.concatenate([rng.permutation(n_seq) for _ in range(epochs)]).astype(np.int64)
    seq_length = int(rng.integers(1, 200))
    total = int(sizes.astype(np.int64).sum()) * epochs
    num_samples = (total - 1) // seq_length
    native = helpers.build_sample_idx(sizes, doc_idx, seq_length, num_samples)
    reference = helpers.build_sample_idx_py(sizes, doc_idx, seq_length, num_samples)
    assert native.dtype == np.int64 and native.shape == (num_samples + 1, 2)
    np.testing.assert_array_equal(native, reference)
    # Every sample covers exactly seq_length + 1 tokens of the document stream.
    starts = np.concatenate([[0], np.cumsum(sizes[doc_idx].astype(np.int64))])
    flat = starts[native[:, 0]] + native[:, 1]
    np.testing.assert_array_equal(np.diff(flat), seq_length)


@pytest.mark.parametrize("builder", [helpers.build_sample_idx, helpers.build_sample_idx_py])
def test_sample_idx_errors(builder):
    sizes = np.array([5, 5], dtype=np.int32)
    with pytest.raises(ValueError, match="document index exhausted after 4 samples"):
        builder(sizes, np.array([0, 1]), 2, 5)
    with pytest.raises(ValueError, match=r"doc_idx\[1\] = 7 is outside \[0, 2\)"):
        builder(sizes, np.array([0, 7]), 4, 2)
    with pytest.raises(ValueError, match="seq_length must be >= 1"):
        builder(sizes, np.array([0, 1]), 0, 1)


@pytest.mark.parametrize("trial", range(10))
def test_blending_matches_reference_and_weights(trial):
    rng = np.random.default_rng(100 + trial)
    weights = rng.random(int(rng.integers(1, 7)))
    weights[rng.random(weights.size) < 0.2] = 0.0
    if weights.sum() == 0:
        weights[0] = 1.0
    weights /= weights.sum()
    size = int(rng.integers(0, 3000))
    idx, sample = helpers.build_blending_indices(weights, size)
    ref_idx, ref_sample = helpers.build_blending_indices_py(weights, size)
    np.testing.assert_array_equal(idx, ref_idx)
    np.testing.assert_array_equal(sample, ref_sample)
    # Every prefix of the blend is within one sample of the weights, per dataset.
    counts = np.zeros((size + 1, weights.size))
    if size:
        counts[1:] = np.cumsum(np.eye(weights.size)[idx], axis=0)
    targets = np.arange(size + 1)[:, None] * weights[None, :]
    assert np.abs(counts - targets).max() <= 1.0 + 1e-9
    # The k-th sample drawn from a dataset is its item k.
    for d in range(weights.size):
        np.testing.assert_array_equal(sample[idx == d], np.arange((idx == d).sum()))


def test_blending_rejects_bad_weights():
    with pytest.raises(ValueError, match="weights must be >= 0"):
        helpers.build_blending_indices(np.array([0.5, -0.1]), 4)
    with pytest.raises(ValueError, match="non-empty"):
        helpers.build_blending_indices(np.array([]), 4)
