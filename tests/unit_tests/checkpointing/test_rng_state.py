"""A checkpoint's random streams: restored exactly on the same kind of device; the dropout
streams of another kind of device (a GPU checkpoint resumed on a CPU) are left as seeded,
since a generator state cannot cross devices, and the host streams are still restored."""

from __future__ import annotations

import random

import torch

from megatron_lsgd.core.tensor_parallel.random import MODEL_PARALLEL_RNG, RNGStatesTracker
from megatron_lsgd.training.checkpointing.rng import capture_rng_state, restore_rng_state


def _tracker(seed: int) -> RNGStatesTracker:
    tracker = RNGStatesTracker(torch.device("cpu"))
    tracker.add(MODEL_PARALLEL_RNG, seed)
    return tracker


def _draws(tracker: RNGStatesTracker):
    with tracker.fork(MODEL_PARALLEL_RNG):
        dropout = torch.rand(4)
    return random.random(), torch.rand(2), dropout


def test_streams_resume_on_the_same_device_and_host_streams_across_devices():
    saved_by = _tracker(7)
    state = capture_rng_state(saved_by)
    expected = _draws(saved_by)

    here = _tracker(11)
    assert restore_rng_state(state, here) is True
    for a, b in zip(_draws(here), expected):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))

    # the same checkpoint as a GPU run writes it: a CUDA generator's 16-byte Philox states
    from_gpu = dict(state, tracker={k: torch.zeros(16, dtype=torch.uint8) for k in state["tracker"]})
    here = _tracker(11)
    seeded = here.state_dict()
    assert restore_rng_state(from_gpu, here) is False
    assert all(torch.equal(here.states[k], v) for k, v in seeded.items())  # dropout: as seeded
    py, host, dropout = _draws(here)  # forks without error
    assert py == expected[0] and torch.equal(host, expected[1])
