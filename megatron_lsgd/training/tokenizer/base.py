"""The interface every tokenizer offers to the data pipeline and the training loop."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import List, Optional, Sequence


class AbstractTokenizer(ABC):
    """`vocab_size` is the unpadded vocabulary (the core pads it for tensor parallelism);
    `eod` is the id appended after every document by preprocessing."""

    name: str = "abstract"

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def eod(self) -> int: ...

    @property
    def bos(self) -> Optional[int]:
        """Beginning-of-sequence id where the tokenizer defines one (exported to Hugging
        Face configs); None otherwise."""
        return None

    @abstractmethod
    def tokenize(self, text: str) -> List[int]: ...

    @abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod})"
