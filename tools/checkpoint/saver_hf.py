"""convert.py saver: a Hugging Face directory (LlamaForCausalLM for Llama-style models,
GPT2LMHeadModel for GPT-2-style), loadable with transformers' from_pretrained; written one
safetensors shard at a time (one model.safetensors up to --max-shard-size)."""

from __future__ import annotations

from megatron_lsgd.training.checkpointing.full_model import FullModel
from megatron_lsgd.training.checkpointing.hf_io import parse_size, tokenizer_info_from_args, write_hf
from megatron_lsgd.training.checkpointing.hf_mapping import to_hf


def add_arguments(parser) -> None:
    g = parser.add_argument_group("hf saver")
    g.add_argument("--max-shard-size", default="5GB",
                   help="largest safetensors file (Hugging Face's save_pretrained default, 5GB); a larger model is "
                        "written as model-0000i-of-0000n.safetensors with model.safetensors.index.json. The "
                        "conversion holds about one shard in memory")


def save_checkpoint(model: FullModel, args) -> str:
    max_shard_bytes = parse_size(args.max_shard_size)
    tokenizer = model.tokenizer or tokenizer_info_from_args(model.args)
    if not tokenizer:
        print("note: the checkpoint does not say which tokenizer it was trained with: the padded vocabulary "
              f"({model.config.padded_vocab_size}) is exported and bos/eos_token_id are not set")
    config, tensors = to_hf(model.params, model.config, tokenizer)
    write_hf(args.save_dir, config, tensors, model.tokenizer_files, max_shard_bytes, model.release)
    return args.save_dir
