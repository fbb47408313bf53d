"""NullTokenizer: text is whitespace-separated integer ids (pre-tokenized data, tests)."""

from __future__ import annotations

from typing import List, Sequence

from .base import AbstractTokenizer


class NullTokenizer(AbstractTokenizer):
    """`--vocab-size N` gives ids 0..N-1, the last of which is the end-of-document id."""

    name = "NullTokenizer"

    def __init__(self, vocab_size: int):
        if vocab_size < 2:
            raise ValueError(f"NullTokenizer: --vocab-size must be >= 2, got {vocab_size}")
        self._vocab_size = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._vocab_size - 1

    def tokenize(self, text: str) -> List[int]:
        ids = []
        for word in text.split():
            try:
                value = int(word)
            except ValueError:
                raise ValueError(f"NullTokenizer: {word!r} is not an integer token id") from None
            if not 0 <= value < self._vocab_size:
                raise ValueError(f"NullTokenizer: token id {value} outside [0, {self._vocab_size})")
            ids.append(value)
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)
