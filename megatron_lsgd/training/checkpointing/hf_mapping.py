"""Our single-rank tensors <-> Hugging Face Llama / GPT-2 tensors and config.json.

Layout facts the mapping relies on:
- fused QKV, per query group: [q_1 .. q_{heads/groups}, k, v], kv_channels rows each;
  HF Llama has separate q/k/v_proj (query head h uses kv head h // (heads/groups));
  HF GPT-2's c_attn is [q; k; v] over all heads.
- SwiGLU fc1 is [gate; up] -> gate_proj, up_proj.
- Rotary: both use rotate-half with inv_freq = base^(-2i/d): no row permutation needed.
- GPT-2 uses Conv1D (y = x W + b, W stored [in, out]): our Linear weights transposed.
- Export writes the tokenizer's true vocabulary (the padding rows are dropped) and its
  bos/eos ids when the checkpoint recorded them; import keeps HF's vocabulary as is.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from megatron_lsgd.core.transformer.config import TransformerConfig
from megatron_lsgd.training.checkpointing.errors import CheckpointError


def family(config: TransformerConfig) -> str:
    """'llama' or 'gpt2', or an error naming what keeps the model from either."""
    c = config
    if c.normalization == "RMSNorm" and c.position_embedding_type == "rope" and c.swiglu:
        if c.rotary_percent != 1.0:
            raise CheckpointError(f"--rotary-percent {c.rotary_percent}: Hugging Face Llama rotates every channel "
                                  f"of a head; this model cannot be exported as Llama")
        return "llama"
    gpt2_needs = {"--normalization LayerNorm": c.normalization == "LayerNorm",
                  "--position-embedding-type learned_absolute": c.position_embedding_type == "learned_absolute",
                  "no --swiglu": not c.swiglu, "no --disable-bias-linear": c.add_bias_linear,
                  "no --untie-embeddings-and-output-weights": not c.untie_embeddings_and_output_weights,
                  "no --group-query-attention": c.num_query_groups == c.num_attention_heads,
                  "kv_channels x heads == hidden": c.kv_channels * c.num_attention_heads == c.hidden_size}
    unmet = [k for k, ok in gpt2_needs.items() if not ok]
    if unmet:
        raise CheckpointError("this model is neither Llama-style (RMSNorm + rope + SwiGLU) nor GPT-2-style; "
                              f"for GPT-2 it lacks: {', '.join(unmet)}")
    return "gpt2"


def _split_qkv(w: torch.Tensor, c: TransformerConfig):
    g, d = c.num_query_groups, c.kv_channels
    qpg = c.num_attention_heads // g
    w = w.reshape(g, qpg + 2, d, *w.shape[1:])
    q = w[:, :qpg].reshape(g * qpg * d, *w.shape[3:])
    return q, w[:, qpg].reshape(g * d, *w.shape[3:]), w[:, qpg + 1].reshape(g * d, *w.shape[3:])


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: TransformerConfig) -> torch.Tensor:
    g, d = c.num_query_groups, c.kv_channels
    qpg = c.num_attention_heads // g
    rest = q.shape[1:]
    fused = torch.cat([q.reshape(g, qpg, d, *rest), k.reshape(g, 1, d, *rest), v.reshape(g, 1, d, *rest)], dim=1)
    return fused.reshape(-1, *rest)


# ---- Llama ------------------------------------------------------------------------------------
_LLAMA_LAYER = {"input_layernorm.weight": "input_layernorm.weight",
                "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
                "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
                "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
                "mlp.linear_fc2.weight": "mlp.down_proj.weight", "mlp.linear_fc2.bias": "mlp.down_proj.bias"}


def llama_config(c: TransformerConfig) -> Dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.hidden_size,
            "intermediate_size": c.ffn_hidden_size, "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_query_groups,
            "head_dim": c.kv_channels, "hidden_act": "silu", "max_position_embeddings": c.max_position_embeddings,
            "rms_norm_eps": c.norm_epsilon, "rope_theta": c.rotary_base,
            "rope_parameters": {"rope_type": "default", "rope_theta": c.rotary_base},
            "vocab_size": c.padded_vocab_size, "tie_word_embeddings": not c.untie_embeddings_and_output_weights,
            "attention_bias": c.add_bias_linear, "mlp_bias": c.add_bias_linear,
            "initializer_range": c.init_method_std, "torch_dtype": "float32"}


def to_llama(params: Dict[str, torch.Tensor], c: TransformerConfig) -> Dict[str, torch.Tensor]:
    out = {"model.embed_tokens.weight": params["embedding.word_embeddings.weight"],
           "model.norm.weight": params["final_layernorm.weight"]}
    if c.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = params["output_layer.weight"]
    for i in range(c.num_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        for a, b in _LLAMA_LAYER.items():
            if ours + a in params:
                out[hf + b] = params[ours + a]
        for suffix in ("weight", "bias"):
            key = f"{ours}self_attention.linear_qkv.{suffix}"
            if key in params:
                q, k, v = _split_qkv(params[key], c)
                out.update({f"{hf}self_attn.q_proj.{suffix}": q, f"{hf}self_attn.k_proj.{suffix}": k,
                            f"{hf}self_attn.v_proj.{suffix}": v})
            key = f"{ours}mlp.linear_fc1.{suffix}"
            if key in params:
                gate, up = params[key].chunk(2, dim=0)
                out.update({f"{hf}mlp.gate_proj.{suffix}": gate, f"{hf}mlp.up_proj.{suffix}": up})
    return out


def _check_heads(hidden: int, heads: int, groups: int, head_dim, names: Tuple[str, str, str]) -> None:
    """config.json head counts that cannot describe a model, named by their fields (instead
    of a reshape error deep in the conversion)."""
    h_name, n_name, g_name = names
    for value, name in ((hidden, h_name), (heads, n_name), (groups, g_name)):
        if not isinstance(value, int) or value < 1:
            raise CheckpointError(f"config.json: {name} = {value!r} must be a positive integer")
    if head_dim is None and hidden % heads:
        raise CheckpointError(f"config.json: {h_name} {hidden} is not divisible by {n_name} {heads} and no head_dim "
                              f"is given")
    if heads % groups:
        raise CheckpointError(f"config.json: {n_name} {heads} is not a multiple of {g_name} {groups}")


def from_llama(cfg: Dict, hf: Dict[str, torch.Tensor]) -> Tuple[TransformerConfig, Dict[str, torch.Tensor]]:
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or cfg.get("rope_scaling"):
        raise CheckpointError(f"rope scaling {rope or cfg.get('rope_scaling')} is not supported (plain rope only)")
    if cfg.get("attention_bias", False) != cfg.get("mlp_bias", False):
        raise CheckpointError("attention_bias and mlp_bias differ; this model has one --disable-bias-linear flag")
    heads = cfg["num_attention_heads"]
    _check_heads(cfg["hidden_size"], heads, cfg.get("num_key_value_heads", heads), cfg.get("head_dim"),
                 ("hidden_size", "num_attention_heads", "num_key_value_heads"))
    c = TransformerConfig(
        num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"], num_attention_heads=heads,
        num_query_groups=cfg.get("num_key_value_heads", heads),
        kv_channels=cfg.get("head_dim") or cfg["hidden_size"] // heads, ffn_hidden_size=cfg["intermediate_size"],
        seq_length=min(cfg["max_position_embeddings"], 4096), max_position_embeddings=cfg["max_position_embeddings"],
        padded_vocab_size=cfg["vocab_size"], position_embedding_type="rope",
        rotary_base=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))), normalization="RMSNorm",
        norm_epsilon=cfg.get("rms_norm_eps", 1e-6), swiglu=True, add_bias_linear=bool(cfg.get("attention_bias")),
        untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings", False),
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=cfg.get("initializer_range", 0.02))
    params = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
              "final_layernorm.weight": hf["model.norm.weight"]}
    if c.untie_embeddings_and_output_weights:
        params["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(c.num_layers):
        ours, p = f"layers.{i}.", f"model.layers.{i}."
        for a, b in _LLAMA_LAYER.items():
            if a.endswith("bias") and not c.add_bias_linear:
                continue
            params[ours + a] = hf[p + b]
        for suffix in ("weight", "bias") if c.add_bias_linear else ("weight",):
            params[f"{ours}self_attention.linear_qkv.{suffix}"] = _fuse_qkv(
                hf[f"{p}self_attn.q_proj.{suffix}"], hf[f"{p}self_attn.k_proj.{suffix}"],
                hf[f"{p}self_attn.v_proj.{suffix}"], c)
            params[f"{ours}mlp.linear_fc1.{suffix}"] = torch.cat(
                [hf[f"{p}mlp.gate_proj.{suffix}"], hf[f"{p}mlp.up_proj.{suffix}"]])
    return c, params


# ---- GPT-2 ------------------------------------------------------------------------------------
def gpt2_config(c: TransformerConfig) -> Dict:
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": c.padded_vocab_size,
            "n_positions": c.max_position_embeddings, "n_embd": c.hidden_size, "n_layer": c.num_layers,
            "n_head": c.num_attention_heads, "n_inner": c.ffn_hidden_size, "activation_function": "gelu_new",
            "layer_norm_epsilon": c.norm_epsilon, "resid_pdrop": c.hidden_dropout, "embd_pdrop": c.hidden_dropout,
            "attn_pdrop": c.attention_dropout, "scale_attn_weights": True, "tie_word_embeddings": True,
            "initializer_range": c.init_method_std, "torch_dtype": "float32"}


def _gpt2_pairs(i: int):
    """(our name, HF name, transposed) for layer i (Conv1D weights are [in, out])."""
    o, h = f"layers.{i}.", f"transformer.h.{i}."
    return [(o + "input_layernorm.weight", h + "ln_1.weight", False), (o + "input_layernorm.bias", h + "ln_1.bias", False),
            (o + "self_attention.linear_proj.weight", h + "attn.c_proj.weight", True),
            (o + "self_attention.linear_proj.bias", h + "attn.c_proj.bias", False),
            (o + "pre_mlp_layernorm.weight", h + "ln_2.weight", False), (o + "pre_mlp_layernorm.bias", h + "ln_2.bias", False),
            (o + "mlp.linear_fc1.weight", h + "mlp.c_fc.weight", True), (o + "mlp.linear_fc1.bias", h + "mlp.c_fc.bias", False),
            (o + "mlp.linear_fc2.weight", h + "mlp.c_proj.weight", True), (o + "mlp.linear_fc2.bias", h + "mlp.c_proj.bias", False)]


_GPT2_TOP = [("embedding.word_embeddings.weight", "transformer.wte.weight"),
             ("embedding.position_embeddings.weight", "transformer.wpe.weight"),
             ("final_layernorm.weight", "transformer.ln_f.weight"), ("final_layernorm.bias", "transformer.ln_f.bias")]


def to_gpt2(params: Dict[str, torch.Tensor], c: TransformerConfig) -> Dict[str, torch.Tensor]:
    out = {hf: params[ours] for ours, hf in _GPT2_TOP}
    for i in range(c.num_layers):
        for ours, hf, transposed in _gpt2_pairs(i):
            out[hf] = params[ours].t() if transposed else params[ours]
        q, k, v = _split_qkv(params[f"layers.{i}.self_attention.linear_qkv.weight"], c)
        out[f"transformer.h.{i}.attn.c_attn.weight"] = torch.cat([q, k, v]).t()
        q, k, v = _split_qkv(params[f"layers.{i}.self_attention.linear_qkv.bias"], c)
        out[f"transformer.h.{i}.attn.c_attn.bias"] = torch.cat([q, k, v])
    return out


def from_gpt2(cfg: Dict, hf: Dict[str, torch.Tensor]) -> Tuple[TransformerConfig, Dict[str, torch.Tensor]]:
    act = cfg.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise CheckpointError(f"GPT-2 activation {act!r} is not supported (tanh-approximated GELU only)")
    if cfg.get("scale_attn_by_inverse_layer_idx") or cfg.get("reorder_and_upcast_attn") \
            or not cfg.get("scale_attn_weights", True):
        raise CheckpointError("GPT-2 attention scaling variants are not supported")
    # Checkpoints saved from GPT2Model (or the original release) lack the "transformer." prefix.
    hf = {(k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k): v for k, v in hf.items()}
    hidden, n_head = cfg["n_embd"], cfg["n_head"]
    _check_heads(hidden, n_head, n_head, None, ("n_embd", "n_head", "n_head"))
    c = TransformerConfig(
        num_layers=cfg["n_layer"], hidden_size=hidden, num_attention_heads=n_head,
        ffn_hidden_size=cfg.get("n_inner") or 4 * hidden, seq_length=cfg["n_positions"],
        max_position_embeddings=cfg["n_positions"], padded_vocab_size=cfg["vocab_size"],
        position_embedding_type="learned_absolute", normalization="LayerNorm",
        norm_epsilon=cfg.get("layer_norm_epsilon", 1e-5), swiglu=False, add_bias_linear=True,
        untie_embeddings_and_output_weights=False, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=cfg.get("initializer_range", 0.02))
    params = {ours: hf[name] for ours, name in _GPT2_TOP}
    for i in range(c.num_layers):
        for ours, name, transposed in _gpt2_pairs(i):
            params[ours] = hf[name].t() if transposed else hf[name]
        w = hf[f"transformer.h.{i}.attn.c_attn.weight"].t()
        params[f"layers.{i}.self_attention.linear_qkv.weight"] = _fuse_qkv(*w.chunk(3), c)
        b = hf[f"transformer.h.{i}.attn.c_attn.bias"]
        params[f"layers.{i}.self_attention.linear_qkv.bias"] = _fuse_qkv(*b.chunk(3), c)
    return c, params


# HF-side tensors that are buffers, not weights, and may appear in old checkpoints.
IGNORED_HF_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


_VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight", "transformer.wte.weight")


def to_hf(params: Dict[str, torch.Tensor], c: TransformerConfig,
          tokenizer: Optional[Dict] = None) -> Tuple[Dict, Dict[str, torch.Tensor]]:
    """HF config.json and tensors. `tokenizer` ({"vocab_size", "eod", "bos"}, recorded at save
    time) trims the padded vocabulary to the true one and sets bos/eos_token_id."""
    kind = family(c)
    if c.apply_layernorm_1p:  # stored centred on zero; Hugging Face multiplies by the weight itself
        params = {k: v + 1 if k.endswith("layernorm.weight") else v for k, v in params.items()}
    if kind == "llama":
        config, tensors = llama_config(c), to_llama(params, c)
    else:
        config, tensors = gpt2_config(c), to_gpt2(params, c)
    tokenizer = tokenizer or {}
    vocab = tokenizer.get("vocab_size")
    if vocab is not None:
        if vocab > c.padded_vocab_size:
            raise CheckpointError(f"the tokenizer's vocabulary ({vocab}) is larger than the model's embedding "
                                  f"({c.padded_vocab_size} rows)")
        for name in _VOCAB_TENSORS:
            if name in tensors:
                tensors[name] = tensors[name][:vocab]
        config["vocab_size"] = vocab
    if "eod" in tokenizer:
        config["eos_token_id"] = tokenizer["eod"]
        config["bos_token_id"] = tokenizer.get("bos")
        if kind == "gpt2" and config["bos_token_id"] is None:
            config["bos_token_id"] = tokenizer["eod"]  # GPT-2's convention: <|endoftext|> both starts and ends
    return config, tensors


def hf_tokenizer_info(cfg: Dict) -> Dict:
    """The vocabulary and special ids a Hugging Face config.json declares."""
    def first(value):
        return value[0] if isinstance(value, list) and value else value
    info = {"vocab_size": int(cfg["vocab_size"])}
    if first(cfg.get("eos_token_id")) is not None:
        info["eod"] = int(first(cfg["eos_token_id"]))
        bos = first(cfg.get("bos_token_id"))
        info["bos"] = None if bos is None else int(bos)
    return info


def from_hf(cfg: Dict, hf: Dict[str, torch.Tensor]) -> Tuple[TransformerConfig, Dict[str, torch.Tensor]]:
    kind = cfg.get("model_type")
    convert = {"llama": (from_llama, to_llama), "gpt2": (from_gpt2, to_gpt2)}.get(kind)
    if convert is None:
        raise CheckpointError(f"config.json model_type {kind!r}: only 'llama' and 'gpt2' are supported")
    try:
        config, params = convert[0](cfg, hf)
    except KeyError as err:
        raise CheckpointError(f"the Hugging Face {kind} checkpoint lacks tensor {err} (or config field)") from err
    # Round trip the names: anything in the file that we did not use is an error, not silently dropped.
    used = set(convert[1](params, config))
    extra = sorted(k for k in hf if k not in used and not k.endswith(IGNORED_HF_SUFFIXES)
                   and ("transformer." + k) not in used
                   and not (k == "lm_head.weight" and not config.untie_embeddings_and_output_weights))
    if extra:
        raise CheckpointError(f"the Hugging Face {kind} checkpoint holds tensors this model has no place for: "
                              f"{extra[:8]}{' ...' if len(extra) > 8 else ''}")
    return config, {k: v.float().contiguous() for k, v in params.items()}
