"""convert.py saver: a Hugging Face directory (LlamaForCausalLM for Llama-style models,
GPT2LMHeadModel for GPT-2-style), loadable with transformers' from_pretrained."""

from __future__ import annotations

from megatron_lsgd.training.checkpointing.full_model import FullModel
from megatron_lsgd.training.checkpointing.hf_io import tokenizer_info_from_args, write_hf
from megatron_lsgd.training.checkpointing.hf_mapping import to_hf


def add_arguments(parser) -> None:
    pass


def save_checkpoint(model: FullModel, args) -> str:
    tokenizer = model.tokenizer or tokenizer_info_from_args(model.args)
    if not tokenizer:
        print("note: the checkpoint does not say which tokenizer it was trained with: the padded vocabulary "
              f"({model.config.padded_vocab_size}) is exported and bos/eos_token_id are not set")
    config, tensors = to_hf(model.params, model.config, tokenizer)
    write_hf(args.save_dir, config, tensors, model.tokenizer_files)
    return args.save_dir
