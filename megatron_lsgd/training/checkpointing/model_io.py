"""One pipeline stage's (TP slice of the) model as a plain dict, and back.

Parameters are stored under their single-rank names (`global_named_parameters`) with
their partition metadata, so tools/checkpoint/convert.py can merge and re-split them
without building a model. Loading copies into the existing parameters, which are views
of the DDP flat buffer: the buffer stays the storage the optimizer and reducers use.
"""

from __future__ import annotations

from typing import Dict

import torch
from torch import nn

from megatron_lsgd.core.models.gpt.canonical_layout import partition_info
from megatron_lsgd.training.checkpointing.errors import CheckpointError


def model_state(model: nn.Module) -> Dict:
    params, partition = {}, {}
    for name, p in model.global_named_parameters():
        params[name] = p.detach().clone()  # a view would drag the whole flat buffer into the file
        partition[name] = partition_info(p)
    return {"params": params, "partition": partition}


@torch.no_grad()
def load_model_state(model: nn.Module, state: Dict, source: str) -> None:
    """Strict: every parameter present with the same shape, nothing extra."""
    saved = state.get("params")
    if not isinstance(saved, dict):
        raise CheckpointError(f"{source} holds no model parameters")
    expected = dict(model.global_named_parameters())
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{source} does not match this model: missing {missing or 'none'}, "
                              f"unexpected {unexpected or 'none'}")
    for name, p in expected.items():
        value = saved[name]
        if tuple(value.shape) != tuple(p.shape):
            raise CheckpointError(f"{source}: {name} has shape {tuple(value.shape)} in the checkpoint but "
                                  f"{tuple(p.shape)} in this model")
    for name, p in expected.items():
        p.copy_(saved[name].to(dtype=p.dtype, device=p.device))
