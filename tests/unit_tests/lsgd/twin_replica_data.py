"""Test data for the unequal-sites equivalence (test_unequal_sites.py), imported in every
spawned rank (harness.run_distributed_many(..., setup_module=MODULE)).

With 3 data-parallel replicas and micro-batches of MB samples, Megatron's order hands the
replicas consecutive blocks of MB samples of every chunk of 3 MB (data_samplers.py): replica
0 the first, replica 1 the second, replica 2 the third. Here the second block of every chunk
holds the same samples as the first, so data-parallel replicas 0 and 1 always read the same
tokens, whatever the layout (3 sites of one replica, or one site of replicas 0 and 1 and one
of replica 2). Nothing else changes: each sample is still MockGPTDataset's own."""

from __future__ import annotations

from megatron_lsgd.core.datasets.mock_dataset import MockGPTDataset

MODULE = __name__
MICRO_BATCH = 2
REPLICAS = 3

_original = MockGPTDataset.__getitem__


def _twin(self, idx):
    position = int(idx) % (MICRO_BATCH * REPLICAS)
    if MICRO_BATCH <= position < 2 * MICRO_BATCH:  # replica 1's block: replica 0's samples
        idx = int(idx) - MICRO_BATCH
    return _original(self, idx)


MockGPTDataset.__getitem__ = _twin
