"""One pre-norm transformer layer: x + Attn(Norm(x)), then x + MLP(Norm(x))."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lsgd.core.transformer.attention import SelfAttention
from megatron_lsgd.core.transformer.config import TransformerConfig
from megatron_lsgd.core.transformer.mlp import MLP
from megatron_lsgd.core.transformer.norm import build_norm


class TransformerLayer(nn.Module):
    def __init__(self, config: TransformerConfig, tp_group, tp_size: int, rng_tracker, layer_number: int):
        super().__init__()
        self.layer_number = layer_number  # global, 0-based
        self.hidden_dropout = config.hidden_dropout
        self.sequence_parallel = config.sequence_parallel
        self.rng_tracker = rng_tracker
        self.input_layernorm = build_norm(config)
        self.self_attention = SelfAttention(config, tp_group, tp_size, rng_tracker, layer_number)
        self.pre_mlp_layernorm = build_norm(config)
        self.mlp = MLP(config, tp_group)

    def _dropout_add(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if not self.training or self.hidden_dropout == 0.0:
            return residual + h
        if self.sequence_parallel:  # each TP rank holds different tokens
            with self.rng_tracker.fork():
                return residual + F.dropout(h, self.hidden_dropout, True)
        return residual + F.dropout(h, self.hidden_dropout, True)

    def forward(self, x: torch.Tensor, rotary: Optional[tuple], attention_mask: Optional[torch.Tensor]):
        x = self._dropout_add(self.self_attention(self.input_layernorm(x), rotary, attention_mask), x)
        return self._dropout_add(self.mlp(self.pre_mlp_layernorm(x)), x)
