"""A layout-free model: full (unsplit) tensors under single-rank names plus the config.

This is what tools/checkpoint/convert.py passes from a loader to a saver. Its tensors are
lazy (lazy_tensors.py): a name's full tensor is made from the source when a saver asks
for it, so the model is never held whole. `read_lsgd` describes a checkpoint's merged TP
slices and pipeline stages (site 0, the model replica every site starts from after a
sync), and with `with_optimizer` every site's model and optimizer/synchronizer state
(resume_state.py); `write_lsgd` writes a target TP x PP layout one file at a time and
commits the checkpoint atomically.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from megatron_lsgd.core.models.gpt.canonical_layout import param_specs, single_rank_pgs
from megatron_lsgd.core.models.gpt.gpt_model import SHARED_EMBEDDING_NAME, GPTModel
from megatron_lsgd.core.tensor_parallel.random import RNGStatesTracker
from megatron_lsgd.core.transformer.config import TransformerConfig
from megatron_lsgd.core.output_files import written_or_removed
from megatron_lsgd.training.checkpointing import layout
from megatron_lsgd.training.checkpointing.atomic import commit_dir, fsync_tree, write_text_atomic
from megatron_lsgd.training.checkpointing.compat import config_from_dict, model_config_dict
from megatron_lsgd.training.checkpointing.errors import CheckpointError
from megatron_lsgd.training.checkpointing.lazy_tensors import LazyTensors, shape_of
from megatron_lsgd.training.checkpointing.resume_state import (BY_PARAMETER, CheckpointFiles, ResumeState,
                                                               check_target_layout, optimizer_file, pad_rows,
                                                               padded_rows, read_resume_state, site_model)
from megatron_lsgd.training.checkpointing.safe_io import save_file
from megatron_lsgd.training.checkpointing.stage_split import split_slot

VOCAB_PARAMS = (SHARED_EMBEDDING_NAME, "output_layer.weight")


@dataclass
class FullModel:
    config: TransformerConfig
    params: Mapping  # name -> full tensor; a loader's are made on access (LazyTensors)
    args: Dict = field(default_factory=dict)  # training args of the source (tokenizer flags, ...)
    iteration: int = 0
    consumed_samples: int = 0
    tokenizer_files: List[str] = field(default_factory=list)  # paths to carry along
    # The run's tokenizer as recorded at save time: {"vocab_size" (unpadded), "eod", "bos"}.
    tokenizer: Dict = field(default_factory=dict)
    source_has_optimizer: bool = False  # the source held optimizer state
    # Every site's model and optimizer/synchronizer state, when converted with them
    # (None: model weights only; `params` is then site 0's model).
    resume: Optional[ResumeState] = None
    # Closes the source files the loader opened for the tensors made so far (lazy_tensors.py):
    # the saver calls it after each file it writes.
    release: Callable[[], None] = lambda: None


@torch.no_grad()
def to_module(full: FullModel) -> GPTModel:
    """A single-rank GPTModel holding these weights (no process groups needed), in eval mode."""
    check_complete(full, "the model")
    model = GPTModel(full.config, single_rank_pgs(), RNGStatesTracker(torch.device("cpu")))
    for name, p in model.global_named_parameters():
        p.copy_(full.params[name])
    full.release()
    return model.eval()


def check_complete(full: FullModel, source: str) -> None:
    specs = param_specs(full.config)
    missing = sorted(set(specs) - set(full.params))
    unexpected = sorted(set(full.params) - set(specs))
    if missing or unexpected:
        raise CheckpointError(f"{source} does not match its model config: missing {missing or 'none'}, "
                              f"unexpected {unexpected or 'none'}")
    for name, (shape, _) in specs.items():
        found = shape_of(full.params, name)
        if tuple(found) != shape:
            raise CheckpointError(f"{source}: {name} has shape {tuple(found)}, the config implies {shape}")


def read_lsgd(load_dir: str, with_optimizer: bool = False) -> FullModel:
    """Site 0's model; with `with_optimizer` also every site's model and optimizer and
    synchronizer state (an error if the checkpoint holds none). Tensors are read from the
    memory-mapped files when used (lazy_tensors.py); `release()` closes them."""
    from megatron_lsgd.training.checkpointing.checkpointer import find_checkpoint, read_metadata

    iter_dir = find_checkpoint(load_dir)
    if iter_dir is None:
        raise CheckpointError(f"{os.path.join(load_dir, layout.TRACKER)} is missing: no checkpoint in {load_dir}")
    meta = read_metadata(iter_dir)
    has_optimizer = bool(meta.get("has_optimizer"))
    if with_optimizer and not has_optimizer:
        raise CheckpointError(f"--load-dir {load_dir} holds no optimizer state (saved with --no-save-optim, or "
                              f"converted with --model-only): pass --model-only to convert the model weights alone")
    src = CheckpointFiles(iter_dir, meta)
    resume = read_resume_state(src) if with_optimizer else None
    params = resume.sites[0].params if resume is not None else site_model(src.for_site(0), 0)[0]
    full = FullModel(config_from_dict(meta["model_config"]), params, meta.get("args", {}), meta["iteration"],
                     meta["consumed_samples"], tokenizer=dict(meta.get("tokenizer") or {}),
                     source_has_optimizer=has_optimizer, resume=resume, release=src.files.release)
    check_complete(full, iter_dir)
    return full


def _pad_vocab(full: FullModel, multiple: int) -> None:
    vocab = full.config.padded_vocab_size
    padded = -(-vocab // multiple) * multiple
    if padded == vocab:
        return
    full.params = padded_rows(full.params, VOCAB_PARAMS, padded)
    if full.resume is not None:
        pad_rows(full.resume, VOCAB_PARAMS, padded)
    full.config.padded_vocab_size = padded


def _target_files(full: FullModel, tp: int, pp: int) -> Iterator[Tuple[str, Callable[[], Dict]]]:
    """(relative path, a function making its content) of every model (and optimizer) file of
    the target layout: one file is made at a time, from the source tensors it needs."""
    specs = param_specs(full.config)
    partition = {name: info for name, (_, info) in specs.items()}
    tied = not full.config.untie_embeddings_and_output_weights
    n = full.config.num_layers

    def model_file(params: Mapping, slot):
        def make():
            ordered = LazyTensors({name: shape_of(params, name) for name in specs}, params.__getitem__)
            local = split_slot(ordered, partition, slot, tp, pp, n, tied)
            return {"params": local, "partition": {name: partition[name] for name in local}}
        return make

    def optimizer(site, slot):
        return lambda: optimizer_file(site, partition, slot, tp, pp, n, tied)

    slots = [(t, p) for t in range(tp) for p in range(pp)]
    if full.resume is None:
        for slot in slots:
            yield os.path.join(layout.mp_rank_dir_name(*slot, pp), layout.model_file_name(0)), \
                model_file(full.params, slot)
        return
    for s, site in enumerate(full.resume.sites):
        for slot in slots:
            mp_dir = layout.mp_rank_dir_name(*slot, pp)
            yield os.path.join(mp_dir, layout.model_file_name(s)), model_file(site.params, slot)
            yield os.path.join(mp_dir, layout.optimizer_file_name(s)), optimizer(site, slot)


def write_lsgd(full: FullModel, save_dir: str, tp: int, pp: int) -> str:
    """A checkpoint for TP x PP; returns its iteration directory. Model weights only (one
    site; load it with --no-load-optim --no-load-rng, or --finetune), or, when `full.resume`
    is set, every site's model with its optimizer and synchronizer state (load it with
    --no-load-rng, at any DP_intra). One target file is made and written at a time, and the
    source files it was made from are released before the next (`full.release`)."""
    from megatron_lsgd.training.checkpointing.checkpointer import FORMAT, FORMAT_VERSION

    check_complete(full, "the converted model")
    if full.resume is not None:
        check_target_layout(full.resume, pp)
    full.config.validate(tp, pp)
    _pad_vocab(full, tp)
    os.makedirs(save_dir, exist_ok=True)
    partial = os.path.join(save_dir, layout.partial_dir_name(full.iteration))
    final = os.path.join(save_dir, layout.iteration_dir_name(full.iteration))
    if os.path.exists(partial):
        shutil.rmtree(partial)
    with written_or_removed(partial, report_as=f"the converted checkpoint {partial}"):
        files, digests = {}, {}
        for rel, make in _target_files(full, tp, pp):
            os.makedirs(os.path.join(partial, os.path.dirname(rel)), exist_ok=True)
            state = make()
            files[rel], digests[rel] = save_file(state, os.path.join(partial, rel), rel)
            del state
            full.release()
        args = dict(full.args)
        # one TP x PP on every site now and sites of one size, whatever the source's sites had
        # (a refused resume names the flags that differ from these: checkpointer._changed_flags)
        args.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                    site_tensor_model_parallel_sizes=None, site_pipeline_model_parallel_sizes=None,
                    site_data_parallel_sizes=None)
        if full.tokenizer_files:  # carried along; point the args at the copy
            args["tokenizer_model"] = os.path.join(os.path.abspath(final), "tokenizer")
        metadata = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "iteration": full.iteration,
            "consumed_samples": full.consumed_samples, "layout": {"tp": tp, "pp": pp, "dp_intra": 1, "sites": 1},
            "use_distributed_optimizer": False, "lsgd_algorithm": args.get("lsgd_algorithm", "sync"),
            "has_optimizer": False, "has_rng": False, "scheduler": None,
            "model_config": model_config_dict(full.config), "tokenizer": full.tokenizer, "args": args,
            "files": files, "sha256": digests}
        if full.resume is not None:  # any DP_intra, with or without ZeRO-1, loads the state by parameter
            metadata.update(full.resume.metadata)
            metadata.update(layout={"tp": tp, "pp": pp, "dp_intra": None, "sites": len(full.resume.sites)},
                            use_distributed_optimizer=None, has_optimizer=True, optimizer_layout=BY_PARAMETER)
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
