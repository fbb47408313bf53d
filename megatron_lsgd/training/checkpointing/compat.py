"""What must agree between a checkpoint and the run loading it."""

from __future__ import annotations

from dataclasses import asdict
from typing import Dict, List

from megatron_lsgd.core.transformer.config import TransformerConfig
from megatron_lsgd.training.checkpointing.errors import CheckpointError

# Fields that change parameter shapes or the function the weights compute. Dropout,
# init std, sequence length, sequence parallelism and dtype may differ on resume.
ARCHITECTURE_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
    "max_position_embeddings", "padded_vocab_size", "position_embedding_type", "rotary_base", "normalization",
    "norm_epsilon", "swiglu", "add_bias_linear", "untie_embeddings_and_output_weights", "apply_layernorm_1p",
    "rotary_percent")
# What a checkpoint written before a field existed meant by its absence.
_ABSENT_MEANS = {"apply_layernorm_1p": False, "rotary_percent": 1.0}

# The flags of the architecture fields that the model group does not declare (for error messages).
_OTHER_FLAGS = {"padded_vocab_size": "--vocab-size/--make-vocab-size-divisible-by (padded vocabulary)",
                "apply_layernorm_1p": "--apply-layernorm-1p", "rotary_percent": "--rotary-percent"}


def _flag(key: str) -> str:
    """The flag that sets an architecture field: its own declaration, or _OTHER_FLAGS."""
    declared = {f.name: f.metadata["flag"] for f in TransformerConfig.option_fields()}
    return declared.get(key) or _OTHER_FLAGS[key]


def model_config_dict(config: TransformerConfig) -> Dict:
    d = asdict(config)
    d["params_dtype"] = str(config.params_dtype).replace("torch.", "")
    return d


def config_from_dict(d: Dict) -> TransformerConfig:
    import torch

    d = dict(d)
    d["params_dtype"] = getattr(torch, d.get("params_dtype", "float32"))
    known = set(TransformerConfig.__dataclass_fields__)
    return TransformerConfig(**{k: v for k, v in d.items() if k in known})


def architecture_differences(saved: Dict, current: Dict) -> List[str]:
    out = []
    for key in ARCHITECTURE_FIELDS:
        a, b = saved.get(key, _ABSENT_MEANS.get(key)), current.get(key, _ABSENT_MEANS.get(key))
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
            same = float(a) == float(b)
        else:
            same = a == b
        if not same:
            out.append(f"{key} ({_flag(key)}): checkpoint {a!r}, this run {b!r}")
    return out


def check_model_config(saved: Dict, current: TransformerConfig, source: str) -> None:
    diffs = architecture_differences(saved, model_config_dict(current))
    if diffs:
        raise CheckpointError(f"the model configuration disagrees with the checkpoint {source}:\n  "
                              + "\n  ".join(diffs))


def check_layout(saved: Dict, tp: int, pp: int, source: str) -> None:
    if saved["tp"] != tp or saved["pp"] != pp:
        raise CheckpointError(
            f"checkpoint {source} was saved with tensor-parallel size {saved['tp']} x pipeline-parallel size "
            f"{saved['pp']}, but this run uses TP {tp} x PP {pp}. Convert it first: python "
            f"tools/checkpoint/convert.py --model-type GPT --loader lsgd --saver lsgd --load-dir <load> "
            f"--save-dir <new> --target-tensor-parallel-size {tp} --target-pipeline-parallel-size {pp}")


def check_site_layouts(saved: Dict, dims, source: str) -> None:
    """Sites of different TP x PP (--site-tensor/pipeline-model-parallel-sizes): each site
    resumes from its own files in its own layout, so the run must have the saved layouts."""
    def words(tps, pps) -> str:
        return f"site layouts TP {','.join(map(str, tps))} x PP {','.join(map(str, pps))}" if tps else \
            "one layout on every site"
    mine = (list(dims.site_tp), list(dims.site_pp)) if dims.mixed_layouts else ([], [])
    theirs = (list(saved.get("site_tp", [])), list(saved.get("site_pp", [])))
    if mine != theirs:
        raise CheckpointError(f"checkpoint {source} was saved with {words(*theirs)}, this run has {words(*mine)}: "
                              f"sites of different layouts resume with the same --site-tensor-model-parallel-sizes "
                              f"and --site-pipeline-model-parallel-sizes (convert.py converts site 0's model of "
                              f"such a checkpoint, --model-only)")
