"""Model configuration (Megatron's TransformerConfig, reduced to what this model uses)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from megatron_lsgd.core.options import AS_GIVEN, OptionGroup, option
from megatron_lsgd.core.transformer import recompute


@dataclass
class TransformerConfig(OptionGroup):
    """Each field with a flag declares it here once (the command line's model group); the
    vocabulary, dtype and sequence parallelism come from elsewhere, the Megatron extras
    (--apply-layernorm-1p, --rotary-percent, --attention-backend, ...) from their own flags
    (training/megatron_compat.py). Defaults serve models built in code; the flags marked
    required must be given on the command line."""

    title: ClassVar[str] = "model"

    num_layers: int = option("--num-layers", 2, type=int, required=True, help="transformer layers")
    hidden_size: int = option("--hidden-size", 64, type=int, required=True, help="width of the residual stream")
    ffn_hidden_size: Optional[int] = option(  # default 4h (GELU) or Llama's 8h/3 rounded (SwiGLU)
        "--ffn-hidden-size", None, type=int,
        help="MLP width; default 4 x hidden (GELU) or about 8/3 x hidden rounded to 64 (SwiGLU)")
    num_attention_heads: int = option("--num-attention-heads", 4, type=int, required=True,
                                      help="query heads per layer")
    num_query_groups: Optional[int] = option(  # None: multi-head attention (groups == heads)
        "--num-query-groups", None, type=int, help="key/value heads under --group-query-attention")
    kv_channels: Optional[int] = option(  # left unset when the heads do not divide the width
        "--kv-channels", None, type=int, help="width of one attention head; default --hidden-size / "
                                              "--num-attention-heads")
    seq_length: int = option("--seq-length", 128, type=int, required=True, help="tokens per training sample")
    max_position_embeddings: Optional[int] = option(
        "--max-position-embeddings", None, type=int,
        help="positions a learned position embedding holds; default --seq-length")
    position_embedding_type: str = option("--position-embedding-type", "learned_absolute", type=AS_GIVEN,
                                          choices=["learned_absolute", "rope"],
                                          help="learned absolute positions (GPT-2) or rotary embeddings (Llama)")
    rotary_base: float = option("--rotary-base", 10000.0, help="rope: base of the rotary frequencies")
    normalization: str = option("--normalization", "LayerNorm", type=AS_GIVEN, choices=["LayerNorm", "RMSNorm"],
                                help="normalization before attention, MLP and the output layer")
    norm_epsilon: float = option("--norm-epsilon", 1e-5, help="epsilon of the normalization")
    swiglu: bool = option("--swiglu", False, help="SwiGLU MLP (gated SiLU) instead of GELU")
    add_bias_linear: bool = option("--disable-bias-linear", True, negates=True,
                                   help="no bias in the linear layers (Llama)")
    untie_embeddings_and_output_weights: bool = option(
        "--untie-embeddings-and-output-weights", False, help="a separate output layer instead of the word embedding "
                                                             "reused")
    hidden_dropout: float = option("--hidden-dropout", 0.1, help="dropout after attention and MLP, before the "
                                                                 "residual add")
    attention_dropout: float = option("--attention-dropout", 0.1, help="dropout on the attention weights")
    init_method_std: float = option("--init-method-std", 0.02,
                                    help="standard deviation of the normal weight initialization")
    # activation recomputation, Megatron's flags (recompute.py): full | selective; uniform | block
    recompute_granularity: Optional[str] = option(
        "--recompute-granularity", None, type=AS_GIVEN, choices=["full", "selective"],
        help="recompute activations in backward: full transformer layers (with --recompute-method), or "
             "selective: the core attention of every layer")
    recompute_method: Optional[str] = option(
        "--recompute-method", None, type=AS_GIVEN, choices=["uniform", "block"],
        help="full: uniform recomputes every layer in chunks of --recompute-num-layers; block only the first "
             "--recompute-num-layers layers of each pipeline stage")
    recompute_num_layers: Optional[int] = option(
        "--recompute-num-layers", None, type=int,
        help="layers per recomputed chunk (uniform) or layers recomputed per stage (block)")
    padded_vocab_size: int = 128
    sequence_parallel: bool = False
    params_dtype: torch.dtype = torch.float32
    apply_layernorm_1p: bool = False  # norms multiply by (1 + weight), weights initialized to 0
    rotary_percent: float = 1.0  # share of each head's channels that rope rotates
    attention_backend: str = "auto"  # SDPA kernels: auto | flash | fused | unfused | local
    calculate_per_token_loss: bool = False  # loss normalized by the step's loss tokens (not per micro-batch)

    @property
    def rotary_dim(self) -> int:
        return int(self.kv_channels * self.rotary_percent)

    def __post_init__(self):
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        # Only an exact default: a hidden size the heads do not divide stays unset, so that
        # validate() can tell the user instead of silently training a narrower attention.
        if self.kv_channels is None and self.num_attention_heads > 0 \
                and self.hidden_size % self.num_attention_heads == 0:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.ffn_hidden_size is None:
            if self.swiglu:  # keep parameter count close to 4h GELU, rounded to 64
                self.ffn_hidden_size = ((int(8 * self.hidden_size / 3) + 63) // 64) * 64
            else:
                self.ffn_hidden_size = 4 * self.hidden_size

    def validate(self, tp: int = 1, pp: int = 1) -> None:
        """Check the model against the parallel layout; messages name the flag to change."""
        def need(cond: bool, msg: str):
            if not cond:
                raise ValueError(msg)

        need(self.num_layers >= 1, "--num-layers must be >= 1")
        recompute.validate(self.recompute_granularity, self.recompute_method, self.recompute_num_layers,
                           self.num_layers // max(1, pp))
        need(self.hidden_size >= 1 and self.num_attention_heads >= 1,
             "--hidden-size and --num-attention-heads must be >= 1")
        need(self.kv_channels is not None,
             f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
             f"{self.num_attention_heads}; change one of them or set --kv-channels (the per-head size)")
        need(self.kv_channels >= 1, f"--kv-channels must be >= 1 (got {self.kv_channels})")
        need(self.num_query_groups >= 1, f"--num-query-groups must be >= 1 (got {self.num_query_groups})")
        need(self.ffn_hidden_size >= 1, f"--ffn-hidden-size must be >= 1 (got {self.ffn_hidden_size})")
        need(self.max_position_embeddings >= 1,
             f"--max-position-embeddings must be >= 1 (got {self.max_position_embeddings})")
        need(self.norm_epsilon > 0, f"--norm-epsilon must be > 0 (got {self.norm_epsilon})")
        need(self.init_method_std >= 0, f"--init-method-std must be >= 0 (got {self.init_method_std})")
        need(self.rotary_base > 0, f"--rotary-base must be > 0 (got {self.rotary_base})")
        need(self.num_attention_heads % self.num_query_groups == 0,
             f"--num-attention-heads {self.num_attention_heads} must be a multiple of "
             f"--num-query-groups {self.num_query_groups}")
        need(self.num_attention_heads % tp == 0,
             f"--num-attention-heads {self.num_attention_heads} is not divisible by "
             f"--tensor-model-parallel-size {tp}")
        need(self.num_query_groups % tp == 0,
             f"--num-query-groups {self.num_query_groups} is not divisible by --tensor-model-parallel-size {tp}")
        need(self.ffn_hidden_size % tp == 0,
             f"--ffn-hidden-size {self.ffn_hidden_size} is not divisible by --tensor-model-parallel-size {tp}")
        need(self.num_layers % pp == 0,
             f"--num-layers {self.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
        need(self.position_embedding_type in ("learned_absolute", "rope"),
             f"--position-embedding-type {self.position_embedding_type!r}: choose learned_absolute or rope")
        need(self.normalization in ("LayerNorm", "RMSNorm"),
             f"--normalization {self.normalization!r}: choose LayerNorm or RMSNorm")
        need(self.seq_length >= 1, "--seq-length must be >= 1")
        need(self.position_embedding_type == "rope" or self.seq_length <= self.max_position_embeddings,
             f"--seq-length {self.seq_length} exceeds --max-position-embeddings {self.max_position_embeddings}")
        need(self.position_embedding_type != "rope" or self.kv_channels % 2 == 0,
             "rotary embeddings need an even head size (--kv-channels)")
        need(0.0 < self.rotary_percent <= 1.0, f"--rotary-percent {self.rotary_percent} must be in (0, 1]")
        need(self.position_embedding_type != "rope" or (self.rotary_dim >= 2 and self.rotary_dim % 2 == 0),
             f"--rotary-percent {self.rotary_percent} of head size {self.kv_channels} gives {self.rotary_dim} "
             f"rotated channels; they must be an even number >= 2")
        need(self.attention_backend in ("auto", "flash", "fused", "unfused", "local"),
             f"--attention-backend {self.attention_backend!r}: choose auto, flash, fused, unfused or local")
        need(0.0 <= self.hidden_dropout < 1.0 and 0.0 <= self.attention_dropout < 1.0,
             "--hidden-dropout and --attention-dropout must be in [0, 1)")
        if self.sequence_parallel:
            need(tp > 1, "--sequence-parallel needs --tensor-model-parallel-size > 1")
            need(self.seq_length % tp == 0,
                 f"--sequence-parallel needs --seq-length {self.seq_length} divisible by "
                 f"--tensor-model-parallel-size {tp}")
