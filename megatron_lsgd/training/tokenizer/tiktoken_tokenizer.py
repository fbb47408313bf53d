"""TikTokenizer: a vocabulary in Megatron's tiktoken format, encoded here (no `tiktoken`
package needed; the `regex` module provides the Unicode classes of the split patterns).

- `--tokenizer-model vocab.json`: a JSON list whose entry r is {"rank": r, "token_bytes":
  base64 of the token's bytes, "token_str": ...}; entries 0..255 are the single bytes.
- Ids: the first `--tiktoken-num-special-tokens` ids (default 1000) are special tokens,
  `--tokenizer-special-tokens` (default <unk> <s> </s> <mask> <pad> <cls> <sep>) followed
  by fillers <SPECIAL_k>; vocabulary entry r has id r + that number. `--vocab-size`
  (default 131072) is the tokenizer's size; entries beyond it are not used.
- Encoding: the text is split by the `--tiktoken-pattern` (v1 or v2); each piece's UTF-8
  bytes start as single bytes and the adjacent pair whose concatenation has the lowest
  rank is joined until no joined pair is in the vocabulary.
- End of document: </s>. Special tokens written in the text are encoded as plain text.
"""

from __future__ import annotations

import base64
import json
import os
from typing import Dict, List, Optional, Sequence

from .base import AbstractTokenizer

DEFAULT_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
DEFAULT_VOCAB_SIZE = 2 ** 17

# The split patterns, built from named parts. A piece is: an optional leading mark (not a
# letter, digit or line break) and a run of letters (v2: an upper-case-ish run followed by
# a lower-case-ish one, so "CamelCase" splits in two); a digit (v1, v2: one at a time);
# punctuation with one optional leading space and trailing line breaks; line breaks with the
# spaces before them; spaces not followed by text; any other spaces.
_LEAD = r"[^\r\n\p{L}\p{N}]"
_UPPERISH = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWERISH = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_PATTERNS = {
    "v1": "|".join([_LEAD + r"?+\p{L}+", r"\p{N}", r" ?[^\s\p{L}\p{N}]++[\r\n]*", r"\s*[\r\n]", r"\s+(?!\S)", r"\s+"]),
    "v2": "|".join([_LEAD + "?" + _UPPERISH + "*" + _LOWERISH + "+", _LEAD + "?" + _UPPERISH + "+" + _LOWERISH + "*",
                    r"\p{N}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"]),
}


def _load_ranks(path: str, limit: int) -> List[bytes]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"TikTokenizer: vocabulary file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not a JSON tiktoken vocabulary ({err})") from None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a JSON list of {{rank, token_bytes, token_str}} entries")
    tokens: List[bytes] = []
    for i, entry in enumerate(entries[:limit]):
        try:
            rank, token = entry["rank"], base64.b64decode(entry["token_bytes"], validate=True)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path}: entry {i} is not {{rank, token_bytes (base64), token_str}} ({err})") from None
        if rank != i:
            raise ValueError(f"{path}: entry {i} has rank {rank}; ranks must be 0, 1, 2, ... in order")
        if i < 256 and token != bytes([i]):
            raise ValueError(f"{path}: entry {i} must be the single byte {i} (the first 256 entries are the bytes)")
        tokens.append(token)
    if len(tokens) < 256:
        raise ValueError(f"{path}: {len(tokens)} entries are used, fewer than the 256 single bytes")
    return tokens


class TikTokenizer(AbstractTokenizer):
    name = "TikTokenizer"

    def __init__(self, path: str, pattern: str = "v2", num_special_tokens: int = 1000,
                 special_tokens: Optional[Sequence[str]] = None, vocab_size: Optional[int] = None):
        import regex  # noqa: PLC0415 - a dependency of the optional HF stack; only this tokenizer needs it

        specials = list(special_tokens or DEFAULT_SPECIAL_TOKENS)
        missing = [t for t in DEFAULT_SPECIAL_TOKENS if t not in specials]
        if missing or len(set(specials)) != len(specials):
            raise ValueError(f"--tokenizer-special-tokens must be unique and include {' '.join(DEFAULT_SPECIAL_TOKENS)}"
                             f"{' (missing ' + ' '.join(missing) + ')' if missing else ''}")
        if len(specials) > num_special_tokens:
            raise ValueError(f"--tiktoken-num-special-tokens {num_special_tokens} is fewer than the {len(specials)} "
                             f"special tokens")
        self._vocab_size = vocab_size or DEFAULT_VOCAB_SIZE
        if self._vocab_size <= num_special_tokens + 256:
            raise ValueError(f"--vocab-size {self._vocab_size} leaves no room for the 256 byte tokens after "
                             f"{num_special_tokens} special tokens")
        self.path = path
        self.num_special_tokens = num_special_tokens
        self._specials = specials + [f"<SPECIAL_{k}>" for k in range(len(specials), num_special_tokens)]
        self._tokens = _load_ranks(path, self._vocab_size - num_special_tokens)
        self._ranks: Dict[bytes, int] = {t: r for r, t in enumerate(self._tokens)}
        self._split = regex.compile(_PATTERNS[pattern])
        self._eod = specials.index("</s>")
        self._bos = specials.index("<s>")

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def bos(self) -> int:
        return self._bos

    def _merge(self, piece: bytes) -> List[int]:
        whole = self._ranks.get(piece)
        if whole is not None:
            return [whole]
        parts = [piece[i:i + 1] for i in range(len(piece))]
        while len(parts) > 1:
            best, best_rank = -1, None
            for i in range(len(parts) - 1):
                rank = self._ranks.get(parts[i] + parts[i + 1])
                if rank is not None and (best_rank is None or rank < best_rank):
                    best, best_rank = i, rank
            if best_rank is None:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        return [self._ranks[p] for p in parts]

    def tokenize(self, text: str) -> List[int]:
        offset = self.num_special_tokens
        ids: List[int] = []
        for piece in self._split.findall(text):
            ids.extend(r + offset for r in self._merge(piece.encode("utf-8")))
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        out, pending = [], bytearray()
        for i in ids:
            i = int(i)
            if i < self.num_special_tokens:
                out.append(pending.decode("utf-8", errors="replace"))
                pending = bytearray()
                out.append(self._specials[i])
            elif i - self.num_special_tokens < len(self._tokens):
                pending += self._tokens[i - self.num_special_tokens]
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)
