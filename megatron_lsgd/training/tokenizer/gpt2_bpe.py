"""GPT-2 byte-level BPE from local `--vocab-file vocab.json` and `--merge-file merges.txt`.

Text is split with GPT-2's pre-tokenization pattern, each piece's UTF-8 bytes are mapped to
printable characters (so every byte string has a spelling), then merged pairwise by rank.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from typing import Dict, List, Sequence, Tuple

from .base import AbstractTokenizer

try:  # `regex` knows Unicode classes; the fallback approximates them with `re`.
    import regex as _re

    _PATTERN = _re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
except ImportError:  # pragma: no cover - regex is a common dependency
    import re as _re

    _PATTERN = _re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+""")

EOD_TOKEN = "<|endoftext|>"
_NO_MERGE = float("inf")


@lru_cache(maxsize=1)
def bytes_to_unicode() -> Dict[int, str]:
    """Byte -> printable character: printable Latin-1 bytes map to themselves, the rest to
    code points from 256 upward, so no byte maps to whitespace or a control character."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


class GPT2BPETokenizer(AbstractTokenizer):
    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str, merge_file: str):
        for path in (vocab_file, merge_file):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"GPT2BPETokenizer: file not found: {path}")
        try:
            with open(vocab_file, encoding="utf-8") as f:
                self.encoder: Dict[str, int] = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{vocab_file}: not a JSON vocabulary ({exc})") from None
        self.decoder = {v: k for k, v in self.encoder.items()}
        self.bpe_ranks: Dict[Tuple[str, str], int] = {}
        with open(merge_file, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                line = line.rstrip("\n")
                if not line or (lineno == 1 and line.startswith("#version")):
                    continue
                parts = line.split(" ")
                if len(parts) != 2:
                    raise ValueError(f"{merge_file}:{lineno}: expected two space-separated symbols, got {line!r}")
                self.bpe_ranks.setdefault((parts[0], parts[1]), len(self.bpe_ranks))
        if EOD_TOKEN not in self.encoder:
            raise ValueError(f"{vocab_file}: vocabulary has no {EOD_TOKEN} token for end of document")
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        self._cache: Dict[str, List[str]] = {}
        self.vocab_file = vocab_file

    @property
    def vocab_size(self) -> int:
        return len(self.encoder)

    @property
    def eod(self) -> int:
        return self.encoder[EOD_TOKEN]

    @property
    def bos(self) -> int:
        return self.encoder[EOD_TOKEN]  # GPT-2 starts and ends text with <|endoftext|>

    def _bpe(self, word: str) -> List[str]:
        cached = self._cache.get(word)
        if cached is not None:
            return cached
        symbols = list(word)
        while len(symbols) > 1:
            best = min(zip(symbols, symbols[1:]), key=lambda p: self.bpe_ranks.get(p, _NO_MERGE))
            if best not in self.bpe_ranks:
                break
            first, second = best
            merged: List[str] = []
            i = 0
            while i < len(symbols):
                if i + 1 < len(symbols) and symbols[i] == first and symbols[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        if len(self._cache) < 100_000:
            self._cache[word] = symbols
        return symbols

    def tokenize(self, text: str) -> List[int]:
        ids: List[int] = []
        for piece in _PATTERN.findall(text):
            spelled = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            for symbol in self._bpe(spelled):
                try:
                    ids.append(self.encoder[symbol])
                except KeyError:
                    raise ValueError(f"{self.vocab_file}: BPE symbol {symbol!r} is not in the vocabulary "
                                     f"(vocab and merges files do not match)") from None
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        spelled = "".join(self.decoder[int(i)] for i in ids)
        return bytearray(self.byte_decoder[c] for c in spelled).decode("utf-8", errors="replace")
