"""convert.py loader: a Hugging Face Llama or GPT-2 directory (config.json + safetensors),
read one tensor at a time when the saver asks for it."""

from __future__ import annotations

from megatron_lsgd.training.checkpointing.full_model import FullModel, check_complete
from megatron_lsgd.training.checkpointing.hf_io import read_hf
from megatron_lsgd.training.checkpointing.hf_mapping import from_hf, hf_tokenizer_info
from megatron_lsgd.training.checkpointing.lazy_tensors import OpenFiles


def add_arguments(parser) -> None:
    pass


def load_checkpoint(args) -> FullModel:
    files = OpenFiles()
    hf_config, tensors, tokenizer_files = read_hf(args.load_dir, files)
    config, params = from_hf(hf_config, tensors)
    # saver_lsgd copies the tokenizer files into the checkpoint and points tokenizer_model there.
    args_out = {"tokenizer_type": "HuggingFaceTokenizer"} if tokenizer_files else {}
    model = FullModel(config, params, args=args_out, tokenizer_files=tokenizer_files,
                      tokenizer=hf_tokenizer_info(hf_config), release=files.release)
    check_complete(model, args.load_dir)
    return model
