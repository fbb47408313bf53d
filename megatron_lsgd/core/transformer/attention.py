"""Causal self-attention: fused QKV (column parallel), RoPE, grouped-query attention through
`scaled_dot_product_attention`, output projection (row parallel). Activations are [s, b, h]."""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import sdpa_kernel

from megatron_lsgd.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_lsgd.core.transformer.config import TransformerConfig
from megatron_lsgd.core.transformer.recompute import checkpointed


def sdpa_backends(name: str):
    """--attention-backend -> the SDPA kernels allowed (None: PyTorch chooses). Megatron's
    names: flash (flash attention), fused (cuDNN, or the memory-efficient kernel), unfused
    and local (the plain math kernel)."""
    from torch.nn.attention import SDPBackend

    return {"auto": None, "flash": [SDPBackend.FLASH_ATTENTION],
            "fused": [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
            "unfused": [SDPBackend.MATH], "local": [SDPBackend.MATH]}[name]


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half convention) evaluated at given positions."""

    def __init__(self, dim: int, base: float):
        super().__init__()
        # computed on the host whatever the default device (a model built on meta or on a GPU
        # gets the same bits, moved with the module)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: torch.Tensor):
        # position_ids [b, s] -> cos, sin [s, b, 1, dim]
        freqs = position_ids.t().unsqueeze(-1).float() * self.inv_freq.to(position_ids.device)
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(2)
        return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] channels of each head (all of them unless
    --rotary-percent < 1); the rest pass through unchanged."""
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :dim], cos, sin), x[..., dim:]], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class SelfAttention(nn.Module):
    def __init__(self, config: TransformerConfig, tp_group, tp_size: int, rng_tracker, layer_number: int):
        super().__init__()
        c = config
        self.heads_per_rank = c.num_attention_heads // tp_size
        self.groups_per_rank = c.num_query_groups // tp_size
        self.head_dim = c.kv_channels
        self.dropout = c.attention_dropout
        self.rng_tracker = rng_tracker
        self.backends = sdpa_backends(c.attention_backend)
        self.selective_recompute = c.recompute_granularity == "selective"
        # Per query group: [q_1..q_{heads/groups}, k, v], groups contiguous, so a plain
        # contiguous TP split of the output dim hands each rank whole groups.
        qkv_out = (c.num_attention_heads + 2 * c.num_query_groups) * c.kv_channels
        out_std = c.init_method_std / math.sqrt(2.0 * c.num_layers)
        self.linear_qkv = ColumnParallelLinear(
            c.hidden_size, qkv_out, tp_group=tp_group, bias=c.add_bias_linear, init_std=c.init_method_std,
            sequence_parallel=c.sequence_parallel, params_dtype=c.params_dtype)
        self.linear_proj = RowParallelLinear(
            c.num_attention_heads * c.kv_channels, c.hidden_size, tp_group=tp_group, bias=c.add_bias_linear,
            init_std=out_std, sequence_parallel=c.sequence_parallel, params_dtype=c.params_dtype)

    def _core_attention(self, q, k, v, dropout: float, kwargs: dict) -> torch.Tensor:
        kernels = contextlib.nullcontext() if self.backends is None else sdpa_kernel(self.backends)
        with kernels:
            if dropout > 0.0:  # heads differ per TP rank, so their dropout must too
                with self.rng_tracker.fork():
                    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, **kwargs)
            return F.scaled_dot_product_attention(q, k, v, **kwargs)

    def forward(self, x: torch.Tensor, rotary: Optional[tuple], attention_mask: Optional[torch.Tensor]):
        qkv = self.linear_qkv(x)
        s, b, _ = qkv.shape
        q_per_group = self.heads_per_rank // self.groups_per_rank
        qkv = qkv.view(s, b, self.groups_per_rank, q_per_group + 2, self.head_dim)
        q = qkv[:, :, :, :q_per_group].reshape(s, b, self.heads_per_rank, self.head_dim)
        k = qkv[:, :, :, q_per_group]
        v = qkv[:, :, :, q_per_group + 1]
        if rotary is not None:
            cos, sin = rotary
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
        # SDPA layout [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        # Causal without a mask (SDPA's flash/efficient kernels); a mask exists only for
        # --reset-attention-mask. GQA: SDPA shares each K/V head with its query group itself
        # (no repeat_interleave copies of K and V).
        kwargs = dict(enable_gqa=True) if q_per_group > 1 else {}
        if attention_mask is None:
            kwargs.update(is_causal=True)
        else:  # Megatron mask: True = masked out (already causal); SDPA wants True = keep
            kwargs.update(attn_mask=~attention_mask)
        if self.selective_recompute and self.training:
            ctx = checkpointed(self._core_attention, self.rng_tracker, q, k, v, dropout, kwargs)
        else:
            ctx = self._core_attention(q, k, v, dropout, kwargs)
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.heads_per_rank * self.head_dim)
        return self.linear_proj(ctx)
