"""Tokenizers selected by `--tokenizer-type` (see docs/data.md)."""

from __future__ import annotations

from .base import AbstractTokenizer
from .config import TOKENIZER_TYPES, TokenizerConfig, padded_vocab_size
from .gpt2_bpe import GPT2BPETokenizer
from .null_tokenizer import NullTokenizer
from .sentencepiece_tokenizer import GPTSentencePieceTokenizer, SentencePieceTokenizer


def build_tokenizer(cfg: TokenizerConfig) -> AbstractTokenizer:
    """The tokenizer named by cfg.tokenizer_type; `vocab_size` is reported unpadded."""
    cfg.validate()
    kind = cfg.tokenizer_type
    if kind == "NullTokenizer":
        return NullTokenizer(int(cfg.vocab_size))
    if kind == "SentencePieceTokenizer":
        return SentencePieceTokenizer(cfg.tokenizer_model)
    if kind == "GPTSentencePieceTokenizer":
        return GPTSentencePieceTokenizer(cfg.tokenizer_model)
    if kind == "HuggingFaceTokenizer":
        from .huggingface_tokenizer import HuggingFaceTokenizer  # noqa: PLC0415 - optional dependency

        return HuggingFaceTokenizer(cfg.tokenizer_model)
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(cfg.vocab_file, cfg.merge_file)
    if kind == "TikTokenizer":
        from .tiktoken_tokenizer import TikTokenizer  # noqa: PLC0415 - needs the `regex` module

        return TikTokenizer(cfg.tokenizer_model, cfg.tiktoken_pattern, cfg.tiktoken_num_special_tokens,
                            cfg.special_tokens, cfg.vocab_size)
    raise ValueError(f"--tokenizer-type {kind!r}: choose one of {', '.join(TOKENIZER_TYPES)}")


__all__ = [
    "AbstractTokenizer", "GPT2BPETokenizer", "GPTSentencePieceTokenizer", "NullTokenizer",
    "SentencePieceTokenizer", "TokenizerConfig", "build_tokenizer", "padded_vocab_size",
]
