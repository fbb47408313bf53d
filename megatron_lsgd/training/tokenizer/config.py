"""Typed configuration of the tokenizer; its flags declared once on its fields (read by training/arguments.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, List, Optional

from megatron_lsgd.core.options import AS_GIVEN, OptionGroup, option

TOKENIZER_TYPES = (
    "NullTokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "GPT2BPETokenizer",
    "TikTokenizer",
)


@dataclass
class TokenizerConfig(OptionGroup):
    """Each field with a flag declares it here once (the command line's tokenizer group);
    TikTokenizer's settings come from Megatron's flags (training/megatron_compat.py)."""

    title: ClassVar[str] = "tokenizer"

    tokenizer_type: Optional[str] = option("--tokenizer-type", None, choices=TOKENIZER_TYPES, type=AS_GIVEN)
    tokenizer_model: Optional[str] = option("--tokenizer-model", None)
    vocab_file: Optional[str] = option("--vocab-file", None)
    merge_file: Optional[str] = option("--merge-file", None)
    vocab_size: Optional[int] = option("--vocab-size", None, type=int,  # NullTokenizer only
                                       help="NullTokenizer vocabulary size; TikTokenizer: its size (default there: "
                                            "131072)")
    make_vocab_size_divisible_by: int = option("--make-vocab-size-divisible-by", 128)
    # TikTokenizer (Megatron's): pre-tokenization pattern, ids reserved for special tokens
    # before the vocabulary, and the special tokens themselves (None: Megatron's default list).
    tiktoken_pattern: str = "v2"
    tiktoken_num_special_tokens: int = 1000
    special_tokens: Optional[List[str]] = None

    def validate(self) -> None:
        if self.tokenizer_type not in TOKENIZER_TYPES:
            raise ValueError(f"--tokenizer-type {self.tokenizer_type!r}: choose one of {', '.join(TOKENIZER_TYPES)}")
        if self.tokenizer_type == "NullTokenizer" and not self.vocab_size:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size N")
        if self.vocab_size is not None and self.vocab_size < 2:
            raise ValueError(f"--vocab-size must be >= 2 (got {self.vocab_size})")
        if self.tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "HuggingFaceTokenizer",
                                   "TikTokenizer") and not self.tokenizer_model:
            raise ValueError(f"--tokenizer-type {self.tokenizer_type} needs --tokenizer-model")
        if self.tokenizer_type == "GPT2BPETokenizer" and not (self.vocab_file and self.merge_file):
            raise ValueError("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
        if self.tiktoken_pattern not in ("v1", "v2"):
            raise ValueError(f"--tiktoken-pattern {self.tiktoken_pattern!r}: choose v1 or v2")
        if self.tokenizer_type == "TikTokenizer" and self.tiktoken_num_special_tokens < 7:
            raise ValueError("--tiktoken-num-special-tokens must be >= 7 (the seven required special tokens)")
        if self.make_vocab_size_divisible_by < 1:
            raise ValueError("--make-vocab-size-divisible-by must be >= 1")


def padded_vocab_size(orig_vocab_size: int, divisible_by: int, tensor_parallel_size: int) -> int:
    """Megatron's padding: round the vocabulary up to a multiple of divisible_by x TP so
    every tensor-parallel rank holds an equal, aligned slice of the embedding."""
    multiple = divisible_by * tensor_parallel_size
    return ((orig_vocab_size + multiple - 1) // multiple) * multiple
