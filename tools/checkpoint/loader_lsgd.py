"""convert.py loader: a megatron_lsgd checkpoint (any TP x PP; site 0's model)."""

from __future__ import annotations

from megatron_lsgd.training.checkpointing.full_model import FullModel, read_lsgd
from megatron_lsgd.training.checkpointing.hf_io import tokenizer_files_from_args


def add_arguments(parser) -> None:
    pass


def load_checkpoint(args) -> FullModel:
    model = read_lsgd(args.load_dir)
    model.tokenizer_files = tokenizer_files_from_args(model.args)
    return model
