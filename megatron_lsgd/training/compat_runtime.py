"""What the Megatron run-time options do while the loop runs (flags in megatron_compat.py).

- `--manual-gc [--manual-gc-interval N] [--no-manual-gc-eval]`: Python's automatic garbage
  collector is off; a collection runs at start-up, every N steps and around evaluation.
- `--profile --profile-step-start S --profile-step-end E [--profile-ranks R ...]`: the
  torch profiler records steps [S, E) on ranks R and writes a trace (TensorBoard's
  profiler plugin reads it) into --tensorboard-dir.
- `--log-throughput`: model FLOPs per step (`flops_per_sample`) for the log line's
  TFLOP/s per rank.
- `--attention-backend`: checked at start-up on the run's device and dtype, so a kernel
  that does not exist there is an error message, not a failure in the first step.
"""

from __future__ import annotations

import gc
import os
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_lsgd.core.transformer.attention import sdpa_backends
from megatron_lsgd.core.transformer.config import TransformerConfig


def flops_per_sample(c: TransformerConfig, vocab_size: int) -> float:
    """Forward + backward FLOPs of one sequence through the model (matrix products only,
    2 FLOPs per multiply-add, backward = 2 x forward), counted here from the layer shapes:
    per token and layer the QKV, output and MLP projections, and the attention scores and
    weighted sum over the full sequence; plus the output layer."""
    s, h, d = c.seq_length, c.hidden_size, c.kv_channels
    qkv = h * (c.num_attention_heads + 2 * c.num_query_groups) * d
    proj = c.num_attention_heads * d * h
    mlp = h * c.ffn_hidden_size * (2 if c.swiglu else 1) + c.ffn_hidden_size * h
    attention = 2 * s * c.num_attention_heads * d  # QK^T and scores x V, per token
    per_token_layer = 2 * (qkv + proj + mlp + attention)
    per_token = c.num_layers * per_token_layer + 2 * h * vocab_size
    return 3.0 * per_token * s


class CompatRuntime:
    def __init__(self, compat, rank: int):
        self.cfg = compat
        self.rank = rank
        self._profiler: Optional[torch.profiler.profile] = None
        if compat.manual_gc:
            gc.disable()
            gc.collect()
        if compat.profile and rank in compat.profile_ranks:
            start, end = compat.profile_step_start, compat.profile_step_end
            os.makedirs(compat.profile_dir, exist_ok=True)
            # Steps are counted from 0 as the loop starts; `step()` follows every step, so
            # the window [start, end) is recorded and then written.
            self._profiler = torch.profiler.profile(
                schedule=torch.profiler.schedule(wait=max(start - 1, 0), warmup=1 if start > 0 else 0,
                                                 active=end - start, repeat=1),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(compat.profile_dir),
                record_shapes=True)
            self._profiler.start()

    def after_step(self, iteration: int) -> None:
        if self.cfg.manual_gc and self.cfg.manual_gc_interval and iteration % self.cfg.manual_gc_interval == 0:
            gc.collect()
        if self._profiler is not None:
            self._profiler.step()

    def around_eval(self) -> None:
        if self.cfg.manual_gc and self.cfg.manual_gc_eval:
            gc.collect()

    def close(self) -> None:
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None
        if self.cfg.manual_gc:
            gc.enable()


def check_attention_backend(c: TransformerConfig, device: torch.device) -> None:
    """Run the chosen SDPA kernels once on a tiny input shaped like the model's (dtype,
    head size, causal, dropout), or raise ValueError naming the flag."""
    backends = sdpa_backends(c.attention_backend)
    if backends is None:
        return
    from torch.nn.attention import sdpa_kernel

    q = torch.zeros(1, 1, 4, c.kv_channels, dtype=c.params_dtype, device=device, requires_grad=True)
    try:
        with sdpa_kernel(backends):
            out = F.scaled_dot_product_attention(q, q, q, is_causal=True, dropout_p=c.attention_dropout)
            out.sum().backward()
    except RuntimeError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"--attention-backend {c.attention_backend}: no such attention kernel for this run "
                         f"({device.type}, {str(c.params_dtype).replace('torch.', '')}, head size {c.kv_channels}, "
                         f"dropout {c.attention_dropout}): {first}. Use --attention-backend auto or unfused") from None
