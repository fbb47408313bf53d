"""convert.py loader: a megatron_lsgd checkpoint (any TP x PP): site 0's model, or, for an
lsgd target without --model-only, every site's model with its optimizer and synchronizer
state (resume_state.py)."""

from __future__ import annotations

from megatron_lsgd.training.checkpointing.full_model import FullModel, read_lsgd
from megatron_lsgd.training.checkpointing.hf_io import tokenizer_files_from_args


def add_arguments(parser) -> None:
    pass


def load_checkpoint(args) -> FullModel:
    model = read_lsgd(args.load_dir, with_optimizer=getattr(args, "with_optimizer", False))
    model.tokenizer_files = tokenizer_files_from_args(model.args)
    return model
