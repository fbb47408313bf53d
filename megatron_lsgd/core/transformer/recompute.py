"""Activation recomputation with Megatron's flags and meaning.

--recompute-granularity full      recompute whole transformer layers in backward, chosen by
  --recompute-method uniform      every layer of the stage, in chunks of
                                  --recompute-num-layers consecutive layers (one checkpoint each)
  --recompute-method block        only the first --recompute-num-layers layers of the stage,
                                  one checkpoint each; the rest keep their activations
--recompute-granularity selective recompute only the core attention (softmax(QK^T)V), whose
                                  activations grow with s^2 outside the fused SDPA kernels

Recomputation replays the same dropout: torch's generator states are restored by
torch.utils.checkpoint, the tensor-parallel tracker's states by `_replay` (they advance
inside the region). Module forward pre-hooks of layers run again while a region is
recomputed; `recomputing()` lets a hook that must run once per forward tell.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, List, Optional

import torch
from torch.utils.checkpoint import checkpoint

GRANULARITIES = ("full", "selective")
METHODS = ("uniform", "block")

_state = threading.local()


def recomputing() -> bool:
    """True while backward re-runs a checkpointed region's forward (on this thread)."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def _replay(tracker, states):
    current = tracker.state_dict()
    tracker.load_state_dict(states)
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
        tracker.load_state_dict(current)


def checkpointed(fn: Callable, rng_tracker, *args):
    """fn(*args) whose activations are dropped and recomputed in backward."""
    def contexts():
        states = rng_tracker.state_dict() if rng_tracker is not None else None
        replay = _replay(rng_tracker, states) if rng_tracker is not None else _flag_only()
        return contextlib.nullcontext(), replay

    if torch.compiler.is_compiling():
        # inside a --compile layer (selective recomputation): dynamo's own checkpoint, which takes
        # no context_fn; the compiled backward recomputes the region. Attention dropout there
        # draws from inductor's generator (not tried with TP's tracker fork: docs/performance.md)
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, context_fn=contexts)


@contextlib.contextmanager
def _flag_only():
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def layer_chunks(granularity: Optional[str], method: Optional[str], num_layers: Optional[int],
                 stage_layers: int) -> List[tuple]:
    """The stage's layers as (first, last + 1, recomputed) runs, in order."""
    if granularity != "full":
        return [(0, stage_layers, False)] if stage_layers else []
    if method == "uniform":
        return [(lo, min(lo + num_layers, stage_layers), True) for lo in range(0, stage_layers, num_layers)]
    n = min(num_layers, stage_layers)  # block
    chunks = [(i, i + 1, True) for i in range(n)]
    return chunks + ([(n, stage_layers, False)] if n < stage_layers else [])


def validate(granularity: Optional[str], method: Optional[str], num_layers: Optional[int],
             stage_layers: int) -> None:
    """Megatron's rules, with the flag to change named."""
    if granularity is None:
        if method is not None or num_layers is not None:
            flag = "--recompute-method" if method is not None else "--recompute-num-layers"
            raise ValueError(f"{flag} needs --recompute-granularity full")
        return
    if granularity == "selective":
        if method is not None or num_layers is not None:
            flag = "--recompute-method" if method is not None else "--recompute-num-layers"
            raise ValueError(f"{flag} applies to --recompute-granularity full only (selective recomputes the "
                             f"core attention of every layer)")
        return
    if method is None:
        raise ValueError("--recompute-granularity full needs --recompute-method uniform or block")
    if num_layers is None or not 1 <= num_layers <= stage_layers:
        raise ValueError(f"--recompute-num-layers must be between 1 and the layers of one pipeline stage "
                         f"({stage_layers}) with --recompute-granularity full")
