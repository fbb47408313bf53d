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

from collections.abc import Mapping
from functools import partial
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch

from megatron_lsgd.core.transformer.config import TransformerConfig
from megatron_lsgd.training.checkpointing.errors import CheckpointError
from megatron_lsgd.training.checkpointing.lazy_tensors import LazyTensors, shape_of

Shape = Tuple[int, ...]


def _same_shape(*shapes: Shape) -> Shape:
    return tuple(shapes[0])


class Recipe(NamedTuple):
    """How one tensor of one side is made from tensors of the other: the input names, the
    function, and the output's shape from the inputs' (ValueError when they do not fit), so
    shapes are known and checked before any value is read."""
    inputs: Tuple[str, ...]
    fn: Callable[..., torch.Tensor]
    shape: Callable[..., Shape] = _same_shape


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def _take(fn: Callable, index: int, *xs: torch.Tensor) -> torch.Tensor:
    return fn(*xs)[index]


def _transposed(x: torch.Tensor) -> torch.Tensor:
    return x.t()


def _transposed_shape(s: Shape) -> Shape:
    if len(s) != 2:
        raise ValueError(f"a matrix was expected, found shape {tuple(s)}")
    return (s[1], s[0])


def made_from(recipes: Dict[str, Recipe], source: Mapping) -> LazyTensors:
    """The tensors `recipes` make from `source`, each made when asked for; their shapes come
    from the inputs' shapes (no values), so a source whose shapes do not fit is an error
    before anything is written."""
    shapes = {}
    for name, recipe in recipes.items():
        found = [tuple(shape_of(source, i)) for i in recipe.inputs]
        try:
            shapes[name] = tuple(recipe.shape(*found))
        except ValueError as err:
            listed = ", ".join(f"{i} {s}" for i, s in zip(recipe.inputs, found))
            raise CheckpointError(f"{name} cannot be made from {listed}: {err}") from None

    def produce(name: str) -> torch.Tensor:
        recipe = recipes[name]
        return recipe.fn(*[source[i] for i in recipe.inputs])
    return LazyTensors(shapes, produce)


def mapped(tensors: Mapping, fn: Callable[[str, torch.Tensor], torch.Tensor]) -> LazyTensors:
    """`tensors` with `fn(name, tensor)` applied to each when it is made (same shapes)."""
    return LazyTensors({n: shape_of(tensors, n) for n in tensors}, lambda n: fn(n, tensors[n]))


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


def _qkv_rows(c: TransformerConfig) -> Tuple[int, int]:
    """(rows of q, rows of k and of v)."""
    return c.num_attention_heads * c.kv_channels, c.num_query_groups * c.kv_channels


def _split_qkv_shape(c: TransformerConfig, index: int, s: Shape) -> Shape:
    q, kv = _qkv_rows(c)
    if s[0] != q + 2 * kv:
        raise ValueError(f"{q + 2 * kv} rows (query heads and key/value groups x kv_channels) were expected")
    return ((q, kv, kv)[index], *s[1:])


def _fuse_qkv_shape(c: TransformerConfig, q: Shape, k: Shape, v: Shape) -> Shape:
    rows_q, rows_kv = _qkv_rows(c)
    if (q[0], k[0], v[0]) != (rows_q, rows_kv, rows_kv) or not q[1:] == k[1:] == v[1:]:
        raise ValueError(f"q with {rows_q} rows and k, v with {rows_kv} rows each, of one width, were expected")
    return (rows_q + 2 * rows_kv, *q[1:])


def _chunk2_shape(index: int, s: Shape) -> Shape:
    if s[0] % 2:
        raise ValueError("an even number of rows ([gate; up]) was expected")
    return (s[0] // 2, *s[1:])


def _cat_shape(*shapes: Shape) -> Shape:
    if any(s[1:] != shapes[0][1:] for s in shapes):
        raise ValueError("tensors of one width were expected")
    return (sum(s[0] for s in shapes), *shapes[0][1:])


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


def _chunk2(x: torch.Tensor):
    return x.chunk(2, dim=0)


def to_llama(params: Mapping, c: TransformerConfig) -> Dict[str, Recipe]:
    """HF name -> how it is made from our tensors (only `params`' names are read)."""
    out = {"model.embed_tokens.weight": Recipe(("embedding.word_embeddings.weight",), _same),
           "model.norm.weight": Recipe(("final_layernorm.weight",), _same)}
    if c.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = Recipe(("output_layer.weight",), _same)
    split = partial(_split_qkv, c=c)
    for i in range(c.num_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        for a, b in _LLAMA_LAYER.items():
            if ours + a in params:
                out[hf + b] = Recipe((ours + a,), _same)
        for suffix in ("weight", "bias"):
            key = f"{ours}self_attention.linear_qkv.{suffix}"
            if key in params:
                for j, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                    out[f"{hf}self_attn.{proj}.{suffix}"] = Recipe((key,), partial(_take, split, j),
                                                                   partial(_split_qkv_shape, c, j))
            key = f"{ours}mlp.linear_fc1.{suffix}"
            if key in params:
                for j, proj in enumerate(("gate_proj", "up_proj")):
                    out[f"{hf}mlp.{proj}.{suffix}"] = Recipe((key,), partial(_take, _chunk2, j),
                                                             partial(_chunk2_shape, j))
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


def _needs(hf: Mapping, *names: str) -> Tuple[str, ...]:
    for name in names:
        if name not in hf:
            raise KeyError(name)
    return names


def _cat(*xs: torch.Tensor) -> torch.Tensor:
    return torch.cat(xs)


def from_llama(cfg: Dict, hf: Mapping) -> Tuple[TransformerConfig, LazyTensors]:
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
    params = {"embedding.word_embeddings.weight": Recipe(_needs(hf, "model.embed_tokens.weight"), _same),
              "final_layernorm.weight": Recipe(_needs(hf, "model.norm.weight"), _same)}
    if c.untie_embeddings_and_output_weights:
        params["output_layer.weight"] = Recipe(_needs(hf, "lm_head.weight"), _same)
    fuse, fuse_shape = partial(_fuse_qkv, c=c), partial(_fuse_qkv_shape, c)
    for i in range(c.num_layers):
        ours, p = f"layers.{i}.", f"model.layers.{i}."
        for a, b in _LLAMA_LAYER.items():
            if a.endswith("bias") and not c.add_bias_linear:
                continue
            params[ours + a] = Recipe(_needs(hf, p + b), _same)
        for suffix in ("weight", "bias") if c.add_bias_linear else ("weight",):
            params[f"{ours}self_attention.linear_qkv.{suffix}"] = Recipe(_needs(
                hf, f"{p}self_attn.q_proj.{suffix}", f"{p}self_attn.k_proj.{suffix}",
                f"{p}self_attn.v_proj.{suffix}"), fuse, fuse_shape)
            params[f"{ours}mlp.linear_fc1.{suffix}"] = Recipe(_needs(
                hf, f"{p}mlp.gate_proj.{suffix}", f"{p}mlp.up_proj.{suffix}"), _cat, _cat_shape)
    return c, made_from(params, hf)


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


def _c_attn(qkv: torch.Tensor, c: TransformerConfig, transposed: bool) -> torch.Tensor:
    q, k, v = _split_qkv(qkv, c)
    out = torch.cat([q, k, v])
    return out.t() if transposed else out


def _c_attn_shape(c: TransformerConfig, transposed: bool, s: Shape) -> Shape:
    _split_qkv_shape(c, 0, s)
    return _transposed_shape(s) if transposed else tuple(s)


def to_gpt2(params: Mapping, c: TransformerConfig) -> Dict[str, Recipe]:
    """HF name -> how it is made from our tensors (only `params`' names are read)."""
    out = {hf: Recipe((ours,), _same) for ours, hf in _GPT2_TOP}
    for i in range(c.num_layers):
        for ours, hf, transposed in _gpt2_pairs(i):
            out[hf] = Recipe((ours,), _transposed, _transposed_shape) if transposed else Recipe((ours,), _same)
        for suffix, transposed in (("weight", True), ("bias", False)):
            out[f"transformer.h.{i}.attn.c_attn.{suffix}"] = Recipe(
                (f"layers.{i}.self_attention.linear_qkv.{suffix}",), partial(_c_attn, c=c, transposed=transposed),
                partial(_c_attn_shape, c, transposed))
    return out


def _fuse_c_attn(w: torch.Tensor, c: TransformerConfig, transposed: bool) -> torch.Tensor:
    return _fuse_qkv(*(w.t() if transposed else w).chunk(3), c)


def _fuse_c_attn_shape(c: TransformerConfig, transposed: bool, s: Shape) -> Shape:
    s = _transposed_shape(s) if transposed else tuple(s)
    if s[0] % 3:
        raise ValueError("[q; k; v] rows divisible by 3 were expected")
    part = (s[0] // 3, *s[1:])
    return _fuse_qkv_shape(c, part, part, part)


def from_gpt2(cfg: Dict, hf: Mapping) -> Tuple[TransformerConfig, LazyTensors]:
    act = cfg.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise CheckpointError(f"GPT-2 activation {act!r} is not supported (tanh-approximated GELU only)")
    if cfg.get("scale_attn_by_inverse_layer_idx") or cfg.get("reorder_and_upcast_attn") \
            or not cfg.get("scale_attn_weights", True):
        raise CheckpointError("GPT-2 attention scaling variants are not supported")
    # Checkpoints saved from GPT2Model (or the original release) lack the "transformer." prefix.
    named = {(k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k): k for k in hf}
    hf = LazyTensors({n: shape_of(hf, k) for n, k in named.items()}, lambda n, src=hf: src[named[n]])
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
    params = {ours: Recipe(_needs(hf, name), _same) for ours, name in _GPT2_TOP}
    for i in range(c.num_layers):
        for ours, name, transposed in _gpt2_pairs(i):
            params[ours] = Recipe(_needs(hf, name), _transposed, _transposed_shape) if transposed \
                else Recipe(_needs(hf, name), _same)
        for suffix, transposed in (("weight", True), ("bias", False)):
            params[f"layers.{i}.self_attention.linear_qkv.{suffix}"] = Recipe(
                _needs(hf, f"transformer.h.{i}.attn.c_attn.{suffix}"),
                partial(_fuse_c_attn, c=c, transposed=transposed), partial(_fuse_c_attn_shape, c, transposed))
    return c, made_from(params, hf)


# HF-side tensors that are buffers, not weights, and may appear in old checkpoints.
IGNORED_HF_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


_VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight", "transformer.wte.weight")


def _one_plus(name: str, v: torch.Tensor) -> torch.Tensor:
    return v + 1 if name.endswith("layernorm.weight") else v


def _rows(vocab: int, fn: Callable, *xs: torch.Tensor) -> torch.Tensor:
    return fn(*xs)[:vocab]


def _rows_shape(vocab: int, shape: Callable, *shapes: Shape) -> Shape:
    s = shape(*shapes)
    return (min(vocab, s[0]), *s[1:])


def to_hf(params: Mapping, c: TransformerConfig, tokenizer: Optional[Dict] = None) -> Tuple[Dict, LazyTensors]:
    """HF config.json and tensors (each made from `params` when asked for). `tokenizer`
    ({"vocab_size", "eod", "bos"}, recorded at save time) trims the padded vocabulary to the
    true one and sets bos/eos_token_id."""
    kind = family(c)
    if c.apply_layernorm_1p:  # stored centred on zero; Hugging Face multiplies by the weight itself
        params = mapped(params, _one_plus)
    if kind == "llama":
        config, recipes = llama_config(c), to_llama(params, c)
    else:
        config, recipes = gpt2_config(c), to_gpt2(params, c)
    tokenizer = tokenizer or {}
    vocab = tokenizer.get("vocab_size")
    if vocab is not None:
        if vocab > c.padded_vocab_size:
            raise CheckpointError(f"the tokenizer's vocabulary ({vocab}) is larger than the model's embedding "
                                  f"({c.padded_vocab_size} rows)")
        for name in _VOCAB_TENSORS:
            if name in recipes:
                r = recipes[name]
                recipes[name] = Recipe(r.inputs, partial(_rows, vocab, r.fn), partial(_rows_shape, vocab, r.shape))
        config["vocab_size"] = vocab
    if "eod" in tokenizer:
        config["eos_token_id"] = tokenizer["eod"]
        config["bos_token_id"] = tokenizer.get("bos")
        if kind == "gpt2" and config["bos_token_id"] is None:
            config["bos_token_id"] = tokenizer["eod"]  # GPT-2's convention: <|endoftext|> both starts and ends
    return config, made_from(recipes, params)


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


def _fp32(name: str, v: torch.Tensor) -> torch.Tensor:
    return v.float().contiguous()


def from_hf(cfg: Dict, hf: Mapping) -> Tuple[TransformerConfig, LazyTensors]:
    """Our config and tensors (fp32, each made from `hf` when asked for)."""
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
    return config, mapped(params, _fp32)
