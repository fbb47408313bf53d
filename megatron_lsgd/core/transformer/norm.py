"""LayerNorm / RMSNorm with the partition metadata the initializer and grad reducer read.

With `apply_layernorm_1p` (Megatron's --apply-layernorm-1p) the weight is stored centred
on zero: it starts at 0 and the layer multiplies by (1 + weight), which keeps the stored
values small (better resolution in low precision, weight decay pulls towards 1 x)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lsgd.core.tensor_parallel.layers import set_partition
from megatron_lsgd.core.transformer.config import TransformerConfig


class LayerNorm1P(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class RMSNorm1P(nn.RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


def build_norm(config: TransformerConfig) -> nn.Module:
    one_p = config.apply_layernorm_1p
    if config.normalization == "RMSNorm":
        cls = RMSNorm1P if one_p else nn.RMSNorm
        norm = cls(config.hidden_size, eps=config.norm_epsilon, dtype=config.params_dtype)
    else:
        cls = LayerNorm1P if one_p else nn.LayerNorm
        norm = cls(config.hidden_size, eps=config.norm_epsilon, dtype=config.params_dtype)
    for name, p in norm.named_parameters():
        set_partition(p, tensor_parallel=False, init="ones" if name == "weight" and not one_p else "zeros")
        # Under sequence parallel each TP rank normalizes part of the sequence: the
        # replicated weights' grads are partial and need a TP all-reduce.
        p.sequence_parallel = config.sequence_parallel
    return norm
