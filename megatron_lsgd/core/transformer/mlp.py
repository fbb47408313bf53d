"""Feed-forward block: fc1 (column parallel) -> GELU or SwiGLU -> fc2 (row parallel)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lsgd.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_lsgd.core.transformer.config import TransformerConfig


class MLP(nn.Module):
    def __init__(self, config: TransformerConfig, tp_group):
        super().__init__()
        c = config
        self.swiglu = c.swiglu
        fc1_out = 2 * c.ffn_hidden_size if c.swiglu else c.ffn_hidden_size
        # SwiGLU's fc1 is [gate; up]; stride 2 gives each TP rank matching halves of both.
        self.linear_fc1 = ColumnParallelLinear(
            c.hidden_size, fc1_out, tp_group=tp_group, bias=c.add_bias_linear, init_std=c.init_method_std,
            stride=2 if c.swiglu else 1, sequence_parallel=c.sequence_parallel, params_dtype=c.params_dtype)
        self.linear_fc2 = RowParallelLinear(
            c.ffn_hidden_size, c.hidden_size, tp_group=tp_group, bias=c.add_bias_linear,
            init_std=c.init_method_std / math.sqrt(2.0 * c.num_layers), sequence_parallel=c.sequence_parallel,
            params_dtype=c.params_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return self.linear_fc2(h)
