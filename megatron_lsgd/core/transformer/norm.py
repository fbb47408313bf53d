"""LayerNorm / RMSNorm with the partition metadata the initializer and grad reducer read."""

from __future__ import annotations

from torch import nn

from megatron_lsgd.core.tensor_parallel.layers import set_partition
from megatron_lsgd.core.transformer.config import TransformerConfig


def build_norm(config: TransformerConfig) -> nn.Module:
    if config.normalization == "RMSNorm":
        norm = nn.RMSNorm(config.hidden_size, eps=config.norm_epsilon, dtype=config.params_dtype)
    else:
        norm = nn.LayerNorm(config.hidden_size, eps=config.norm_epsilon, dtype=config.params_dtype)
    for name, p in norm.named_parameters():
        set_partition(p, tensor_parallel=False, init="ones" if name == "weight" else "zeros")
        # Under sequence parallel each TP rank normalizes part of the sequence: the
        # replicated weights' grads are partial and need a TP all-reduce.
        p.sequence_parallel = config.sequence_parallel
    return norm
