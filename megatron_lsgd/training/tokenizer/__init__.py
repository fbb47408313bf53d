"""Tokenizers (full set arrives with the data pipeline)."""

from megatron_lsgd.training.tokenizer.config import TokenizerConfig, padded_vocab_size


class NullTokenizer:
    """Token ids are given as whitespace-separated integers; eod is the last id."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1

    def tokenize(self, text: str):
        return [int(t) for t in text.split()]

    def detokenize(self, ids) -> str:
        return " ".join(str(i) for i in ids)


def build_tokenizer(cfg: TokenizerConfig):
    if cfg.tokenizer_type == "NullTokenizer":
        return NullTokenizer(cfg.vocab_size)
    raise ValueError(f"--tokenizer-type {cfg.tokenizer_type} is not available in this build")


__all__ = ["build_tokenizer", "padded_vocab_size", "TokenizerConfig"]
