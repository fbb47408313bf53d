"""A layout-free model: full (unsplit) tensors under single-rank names plus the config.

This is what tools/checkpoint/convert.py passes from a loader to a saver. `read_lsgd`
merges the TP slices and pipeline stages of a checkpoint (site 0, the model replica
every site starts from after a sync); `write_lsgd` splits for a target TP x PP layout
and commits a model-only checkpoint atomically.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import torch

from megatron_lsgd.core.models.gpt.gpt_model import SHARED_EMBEDDING_NAME, GPTModel
from megatron_lsgd.core.parallel_state import ParallelDims, ProcessGroups, RankCoords
from megatron_lsgd.core.tensor_parallel.initialize import merge_tp_slices, take_tp_slice
from megatron_lsgd.core.tensor_parallel.random import RNGStatesTracker
from megatron_lsgd.core.transformer.config import TransformerConfig
from megatron_lsgd.core.output_files import written_or_removed
from megatron_lsgd.training.checkpointing import layout
from megatron_lsgd.training.checkpointing.atomic import commit_dir, fsync_tree, write_text_atomic
from megatron_lsgd.training.checkpointing.compat import config_from_dict, model_config_dict
from megatron_lsgd.training.checkpointing.errors import CheckpointError
from megatron_lsgd.training.checkpointing.model_io import partition_info
from megatron_lsgd.training.checkpointing.safe_io import load_file, save_file

VOCAB_PARAMS = (SHARED_EMBEDDING_NAME, "output_layer.weight")


@dataclass
class FullModel:
    config: TransformerConfig
    params: Dict[str, torch.Tensor]
    args: Dict = field(default_factory=dict)  # training args of the source (tokenizer flags, ...)
    iteration: int = 0
    consumed_samples: int = 0
    tokenizer_files: List[str] = field(default_factory=list)  # paths to carry along
    # The run's tokenizer as recorded at save time: {"vocab_size" (unpadded), "eod", "bos"}.
    tokenizer: Dict = field(default_factory=dict)
    source_has_optimizer: bool = False  # the source held optimizer state (dropped by conversion)


def _single_rank_pgs() -> ProcessGroups:
    return ProcessGroups(dims=ParallelDims(), rank=0, coords=RankCoords(0, 0, 0, 0))


@torch.no_grad()
def to_module(full: FullModel) -> GPTModel:
    """A single-rank GPTModel holding these weights (no process groups needed), in eval mode."""
    check_complete(full, "the model")
    model = GPTModel(full.config, _single_rank_pgs(), RNGStatesTracker(torch.device("cpu")))
    for name, p in model.global_named_parameters():
        p.copy_(full.params[name])
    return model.eval()


def param_specs(config: TransformerConfig) -> Dict[str, Tuple[Tuple[int, ...], list]]:
    """Single-rank name -> (full shape, [tensor_parallel, dim, stride]), from a model built
    on the meta device (no memory, no process groups)."""
    with torch.device("meta"):
        model = GPTModel(config, _single_rank_pgs(), RNGStatesTracker(torch.device("cpu")))
    return {name: (tuple(p.shape), partition_info(p)) for name, p in model.global_named_parameters()}


def check_complete(full: FullModel, source: str) -> None:
    specs = param_specs(full.config)
    missing = sorted(set(specs) - set(full.params))
    unexpected = sorted(set(full.params) - set(specs))
    if missing or unexpected:
        raise CheckpointError(f"{source} does not match its model config: missing {missing or 'none'}, "
                              f"unexpected {unexpected or 'none'}")
    for name, (shape, _) in specs.items():
        if tuple(full.params[name].shape) != shape:
            raise CheckpointError(f"{source}: {name} has shape {tuple(full.params[name].shape)}, the config "
                                  f"implies {shape}")


def read_lsgd(load_dir: str) -> FullModel:
    from megatron_lsgd.training.checkpointing.checkpointer import find_checkpoint, read_metadata

    iter_dir = find_checkpoint(load_dir)
    if iter_dir is None:
        raise CheckpointError(f"{os.path.join(load_dir, layout.TRACKER)} is missing: no checkpoint in {load_dir}")
    meta = read_metadata(iter_dir)
    tp, pp = meta["layout"]["tp"], meta["layout"]["pp"]
    slices: Dict[str, Dict[int, torch.Tensor]] = {}
    partition: Dict[str, list] = {}
    for p in range(pp):
        seen_on_stage = set()
        for t in range(tp):
            rel = os.path.join(layout.mp_rank_dir_name(t, p, pp), layout.model_file_name(0))
            state = load_file(os.path.join(iter_dir, rel), meta["files"].get(rel), meta.get("sha256", {}).get(rel))
            for name, value in state["params"].items():
                if name in partition and name not in seen_on_stage:
                    continue  # the last stage's copy of the tied embedding: stage 0 holds it
                seen_on_stage.add(name)
                partition[name] = state["partition"][name]
                slices.setdefault(name, {})[t] = value
    params = {}
    for name, by_rank in slices.items():
        is_tp, dim, stride = partition[name]
        ordered = [by_rank[t] for t in sorted(by_rank)]
        params[name] = merge_tp_slices(ordered, dim, stride) if is_tp and len(ordered) > 1 else ordered[0]
    full = FullModel(config_from_dict(meta["model_config"]), params, meta.get("args", {}), meta["iteration"],
                     meta["consumed_samples"], tokenizer=dict(meta.get("tokenizer") or {}),
                     source_has_optimizer=bool(meta.get("has_optimizer")))
    check_complete(full, iter_dir)
    return full


def _pad_vocab(full: FullModel, multiple: int) -> None:
    vocab = full.config.padded_vocab_size
    padded = -(-vocab // multiple) * multiple
    if padded == vocab:
        return
    for name in VOCAB_PARAMS:
        if name in full.params:
            t = full.params[name]
            full.params[name] = torch.cat([t, t.new_zeros(padded - vocab, *t.shape[1:])])
    full.config.padded_vocab_size = padded


def _stage_of(name: str, per_stage: int, pp: int) -> List[int]:
    if name.startswith("layers."):
        return [int(name.split(".")[1]) // per_stage]
    if name.startswith("embedding."):
        return [0]
    return [pp - 1]  # final norm, output layer


def split_for_layout(full: FullModel, tp: int, pp: int) -> Dict[Tuple[int, int], Dict]:
    """(tp_rank, pp_rank) -> model file content (global names, local slices)."""
    full.config.validate(tp, pp)
    _pad_vocab(full, tp)
    specs = param_specs(full.config)
    tied = not full.config.untie_embeddings_and_output_weights
    per_stage = full.config.num_layers // pp
    out = {(t, p): {"params": {}, "partition": {}} for t in range(tp) for p in range(pp)}
    for name, (_, info) in specs.items():
        stages = _stage_of(name, per_stage, pp)
        if tied and pp > 1 and name == SHARED_EMBEDDING_NAME:
            stages.append(pp - 1)  # the last stage keeps its own copy of the tied output weight
        is_tp, dim, stride = info
        for t in range(tp):
            value = full.params[name]
            value = take_tp_slice(value, dim, stride, tp, t) if is_tp else value
            for p in stages:
                out[(t, p)]["params"][name] = value.clone().contiguous()
                out[(t, p)]["partition"][name] = info
    return out


def write_lsgd(full: FullModel, save_dir: str, tp: int, pp: int) -> str:
    """A model-only checkpoint for TP x PP (one site, one data-parallel rank); returns its
    iteration directory. Load it with --no-load-optim --no-load-rng (or --finetune)."""
    from megatron_lsgd.training.checkpointing.checkpointer import FORMAT, FORMAT_VERSION

    check_complete(full, "the converted model")
    pieces = split_for_layout(full, tp, pp)
    os.makedirs(save_dir, exist_ok=True)
    partial = os.path.join(save_dir, layout.partial_dir_name(full.iteration))
    final = os.path.join(save_dir, layout.iteration_dir_name(full.iteration))
    if os.path.exists(partial):
        shutil.rmtree(partial)
    with written_or_removed(partial, report_as=f"the converted checkpoint {partial}"):
        files, digests = {}, {}
        for (t, p), state in pieces.items():
            rel = os.path.join(layout.mp_rank_dir_name(t, p, pp), layout.model_file_name(0))
            os.makedirs(os.path.join(partial, os.path.dirname(rel)), exist_ok=True)
            files[rel], digests[rel] = save_file(state, os.path.join(partial, rel), rel)
        args = dict(full.args)
        args.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        if full.tokenizer_files:  # carried along; point the args at the copy
            args["tokenizer_model"] = os.path.join(os.path.abspath(final), "tokenizer")
        metadata = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "iteration": full.iteration,
            "consumed_samples": full.consumed_samples, "layout": {"tp": tp, "pp": pp, "dp_intra": 1, "sites": 1},
            "use_distributed_optimizer": False, "lsgd_algorithm": args.get("lsgd_algorithm", "sync"),
            "has_optimizer": False, "has_rng": False, "scheduler": None,
            "model_config": model_config_dict(full.config), "tokenizer": full.tokenizer, "args": args,
            "files": files, "sha256": digests}
        with open(os.path.join(partial, layout.METADATA), "w") as f:
            json.dump(metadata, f, indent=1, sort_keys=True)
        if full.tokenizer_files:
            tok_dir = os.path.join(partial, "tokenizer")
            os.makedirs(tok_dir)
            for path in full.tokenizer_files:
                shutil.copy2(path, tok_dir)
        fsync_tree(partial)
    commit_dir(partial, final)
    write_text_atomic(os.path.join(save_dir, layout.TRACKER), str(full.iteration))
    return final
