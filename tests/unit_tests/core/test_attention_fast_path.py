"""Self-attention reaches SDPA on its fast path: causal by `is_causal` with no explicit mask
(a mask exists only for --reset-attention-mask), and grouped-query attention with K and V
at their own group count (`enable_gqa`, no repeat_interleave copies), giving the numbers
the copies gave."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_lsgd.core.transformer.attention import SelfAttention
from megatron_lsgd.core.transformer.config import TransformerConfig


def test_causal_gqa_reaches_sdpa_without_mask_or_copies(monkeypatch):
    c = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=8, num_query_groups=2, seq_length=6,
                          attention_dropout=0.0, hidden_dropout=0.0)
    torch.manual_seed(0)
    attn = SelfAttention(c, None, 1, None, layer_number=1)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.2)
    sdpa, calls = F.scaled_dot_product_attention, []

    def recording(q, k, v, **kwargs):
        calls.append(((q.shape, k.shape, v.shape), dict(kwargs)))
        out = sdpa(q, k, v, **kwargs)
        reps = q.shape[1] // k.shape[1]  # what the copies computed
        copied = sdpa(q, k.repeat_interleave(reps, dim=1), v.repeat_interleave(reps, dim=1), is_causal=True)
        assert torch.equal(out, copied)
        return out

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    attn(torch.randn(6, 2, 32), None, None).sum().backward()
    (q_shape, k_shape, v_shape), kwargs = calls[0]
    assert q_shape == (2, 8, 6, 4) and k_shape == v_shape == (2, 2, 6, 4)  # two K/V heads, not eight
    assert kwargs == {"is_causal": True, "enable_gqa": True}
