"""Hugging Face directories: config.json + model.safetensors (or a sharded index) +
tokenizer files. safetensors holds raw tensors only, so reading executes nothing."""

from __future__ import annotations

import json
import os
import shutil
from typing import Dict, List, Tuple

import torch

from megatron_lsgd.core.output_files import written_or_removed
from megatron_lsgd.training.checkpointing.atomic import commit_dir, fsync_tree
from megatron_lsgd.training.checkpointing.errors import CheckpointError

# generation_config.json is not a tokenizer file (it holds sampling defaults): never carried.
TOKENIZER_FILE_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                        "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json")


def tokenizer_files_from_args(args: Dict) -> List[str]:
    """Files the run's tokenizer flags point to (a HF tokenizer directory, a SentencePiece
    model, GPT-2 vocab/merges). NullTokenizer has none."""
    files = []
    model = args.get("tokenizer_model")
    if model and os.path.isdir(model):
        files += [os.path.join(model, n) for n in TOKENIZER_FILE_NAMES if os.path.exists(os.path.join(model, n))]
    elif model:
        files.append(model)
    for key in ("vocab_file", "merge_file"):
        if args.get(key):
            files.append(args[key])
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise CheckpointError(f"tokenizer files named by the checkpoint's args are missing: {missing}")
    return files


def tokenizer_info_from_args(args: Dict) -> Dict:
    """For checkpoints saved before metadata.json recorded the tokenizer: rebuild it from the
    run's flags ({} when that is not possible, e.g. the files are gone)."""
    from megatron_lsgd.training.tokenizer import TokenizerConfig, build_tokenizer

    kind = args.get("tokenizer_type") or ("NullTokenizer" if args.get("mock_data") else None)
    if kind is None:
        return {}
    try:
        tok = build_tokenizer(TokenizerConfig(tokenizer_type=kind, tokenizer_model=args.get("tokenizer_model"),
                                              vocab_file=args.get("vocab_file"), merge_file=args.get("merge_file"),
                                              vocab_size=args.get("vocab_size")))
    except (ValueError, OSError, ImportError):
        return {}
    return {"vocab_size": int(tok.vocab_size), "eod": int(tok.eod), "bos": None if tok.bos is None else int(tok.bos)}


def _hf_tokenizer_name(path: str) -> str:
    base = os.path.basename(path)
    if base.endswith(".model"):
        return "tokenizer.model"  # SentencePiece, as HF Llama tokenizers expect it
    if base.endswith(".json") and "vocab" in base:
        return "vocab.json"
    if base.endswith(".txt") and "merge" in base:
        return "merges.txt"
    return base


def write_hf(save_dir: str, config: Dict, tensors: Dict[str, torch.Tensor], tokenizer_files: List[str]) -> None:
    from safetensors.torch import save_file

    partial = save_dir.rstrip("/") + ".partial"
    if os.path.exists(partial):
        shutil.rmtree(partial)
    with written_or_removed(partial, report_as=f"the Hugging Face export {partial}"):
        os.makedirs(partial)
        with open(os.path.join(partial, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        # safetensors refuses shared or non-contiguous storage: give each tensor its own.
        save_file({k: v.detach().to(torch.float32).contiguous().clone() for k, v in tensors.items()},
                  os.path.join(partial, "model.safetensors"), metadata={"format": "pt"})
        for path in tokenizer_files:
            shutil.copy2(path, os.path.join(partial, _hf_tokenizer_name(path)))
        fsync_tree(partial)
    commit_dir(partial, save_dir)


def read_hf(load_dir: str) -> Tuple[Dict, Dict[str, torch.Tensor], List[str]]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config_path = os.path.join(load_dir, "config.json")
    if not os.path.exists(config_path):
        raise CheckpointError(f"{config_path} is missing: not a Hugging Face model directory")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except ValueError as err:
        raise CheckpointError(f"{config_path} is not valid JSON: {err}") from err
    index = os.path.join(load_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(load_dir, "model.safetensors")):
        shards = ["model.safetensors"]
    else:
        raise CheckpointError(f"{load_dir} has neither model.safetensors nor model.safetensors.index.json "
                              f"(pytorch_model.bin is not read: it would unpickle code)")
    tensors: Dict[str, torch.Tensor] = {}
    for shard in shards:
        path = os.path.join(load_dir, shard)
        try:
            tensors.update(load_file(path))
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{path} is unreadable ({err}); truncated or corrupt?") from err
    tok = [os.path.join(load_dir, n) for n in TOKENIZER_FILE_NAMES if os.path.exists(os.path.join(load_dir, n))]
    return config, tensors, tok
