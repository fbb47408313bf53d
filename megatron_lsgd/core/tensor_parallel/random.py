"""RNG state tracker so dropout inside tensor-parallel regions differs across TP ranks
while dropout on replicated activations stays identical on every TP rank."""

from __future__ import annotations

import contextlib
from typing import Dict

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named generator states that can be swapped in for a block of code (`fork`)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.states: Dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        saved = _get_state(self.device)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states[name] = _get_state(self.device)
        _set_state(saved, self.device)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} was never added")
        saved = _get_state(self.device)
        _set_state(self.states[name], self.device)
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device)
            _set_state(saved, self.device)

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def fits(self, states: Dict[str, torch.Tensor]) -> bool:
        """Whether saved states are this device kind's generator states (a CUDA generator's
        state and a CPU one's differ in size)."""
        size = _get_state(self.device).numel()
        return all(v.numel() == size for v in states.values())

    def load_state_dict(self, states: Dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}


def model_parallel_seeds(seed: int, tp_rank: int, pp_rank: int):
    """(default seed, tensor-parallel seed): the default stream differs per pipeline stage
    and is shared across TP ranks; the TP stream differs per TP rank (Megatron's offsets)."""
    default_seed = seed + 100 * pp_rank
    return default_seed, default_seed + 2718 + tp_rank
