"""Hugging Face directories: config.json + model.safetensors (or shards with an index) +
tokenizer files. safetensors holds raw tensors only, so reading executes nothing. Both
directions stream: a tensor is read from its file when used, and an export is written
one shard at a time."""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Mapping
from typing import Callable, Dict, List, Tuple

import torch

from megatron_lsgd.core.output_files import written_or_removed
from megatron_lsgd.training.checkpointing.atomic import commit_dir, fsync_tree
from megatron_lsgd.training.checkpointing.errors import CheckpointError
from megatron_lsgd.training.checkpointing.lazy_tensors import LazyTensors, OpenFiles, shape_of

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


# Hugging Face's own default for save_pretrained's max_shard_size; a larger export is split
# into model-0000i-of-0000n.safetensors with model.safetensors.index.json, as it does.
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


def parse_size(text: str) -> int:
    """'5GB', '200MB', '64KB' (powers of 10, as Hugging Face counts) or a number of bytes."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper()
    for unit, scale in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(unit):
            t, mult = t[:-len(unit)].strip(), scale
            break
    else:
        t, mult = t.removesuffix("B"), 1
    try:
        value = float(t) * mult
    except ValueError:
        raise ValueError(f"--max-shard-size {text!r}: expected a size such as 5GB, 500MB or a number of bytes") \
            from None
    if value < 1:
        raise ValueError(f"--max-shard-size {text!r} must be at least one byte")
    return int(value)


def _shards(tensors: Mapping, max_bytes: int) -> List[List[str]]:
    """The tensors' names in files of at most `max_bytes` (fp32; a larger tensor alone)."""
    shards: List[List[str]] = [[]]
    size = 0
    for name in tensors:
        nbytes = 4 * math.prod(shape_of(tensors, name))
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_hf(save_dir: str, config: Dict, tensors: Mapping, tokenizer_files: List[str],
             max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, release: Callable[[], None] = lambda: None) -> None:
    """config.json, the weights (fp32) and the tokenizer files, committed atomically. The
    weights are made and written one file at a time (`release` after each): one
    model.safetensors when they fit in `max_shard_bytes`, else shards and an index."""
    from safetensors.torch import save_file

    shards = _shards(tensors, max_shard_bytes)
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    partial = save_dir.rstrip("/") + ".partial"
    if os.path.exists(partial):
        shutil.rmtree(partial)
    with written_or_removed(partial, report_as=f"the Hugging Face export {partial}"):
        os.makedirs(partial)
        with open(os.path.join(partial, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        for file_name, shard in zip(names, shards):
            # safetensors refuses shared or non-contiguous storage: give each tensor its own.
            save_file({k: tensors[k].detach().to(torch.float32).contiguous().clone() for k in shard},
                      os.path.join(partial, file_name), metadata={"format": "pt"})
            release()
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(4 * math.prod(shape_of(tensors, k)) for k in tensors)},
                     "weight_map": {k: file_name for file_name, shard in zip(names, shards) for k in shard}}
            with open(os.path.join(partial, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
        for path in tokenizer_files:
            shutil.copy2(path, os.path.join(partial, _hf_tokenizer_name(path)))
        fsync_tree(partial)
    commit_dir(partial, save_dir)


def read_hf(load_dir: str, files: OpenFiles) -> Tuple[Dict, LazyTensors, List[str]]:
    """config.json, the weights (each read from its safetensors file, through `files`, when
    asked for: only the files' headers are read here) and the tokenizer files."""
    from safetensors import SafetensorError, safe_open

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
    where: Dict[str, str] = {}
    shapes: Dict[str, Tuple[int, ...]] = {}
    for shard in shards:
        path = os.path.join(load_dir, shard)
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    where[name] = path
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{path} is unreadable ({err}); truncated or corrupt?") from err

    def produce(name: str) -> torch.Tensor:
        files.settle()
        files.read(4 * math.prod(shapes[name]))
        try:
            return files.safetensors_file(where[name]).get_tensor(name)
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{where[name]} is unreadable ({err}); truncated or corrupt?") from err
    tok = [os.path.join(load_dir, n) for n in TOKENIZER_FILE_NAMES if os.path.exists(os.path.join(load_dir, n))]
    return config, LazyTensors(shapes, produce), tok
