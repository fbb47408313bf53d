"""HuggingFaceTokenizer: a local tokenizer directory or tokenizer.json (optional dependency).

A directory is loaded with `transformers.AutoTokenizer` when transformers is installed,
otherwise its tokenizer.json with the `tokenizers` library; a file always with `tokenizers`.
Nothing is downloaded: only local paths are accepted.
"""

from __future__ import annotations

import os
from typing import List, Optional, Sequence

from .base import AbstractTokenizer

# Tried in order when the tokenizer declares no eos token of its own.
_EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]")


class HuggingFaceTokenizer(AbstractTokenizer):
    name = "HuggingFaceTokenizer"

    def __init__(self, path: str):
        if not os.path.exists(path):
            raise FileNotFoundError(f"HuggingFaceTokenizer: no local tokenizer directory or file at {path}")
        self.path = path
        self._hf = None  # transformers tokenizer
        self._tok = None  # tokenizers.Tokenizer
        if os.path.isdir(path):
            try:
                from transformers import AutoTokenizer  # noqa: PLC0415 - optional dependency
            except ImportError:
                self._tok = self._load_json(os.path.join(path, "tokenizer.json"))
            else:
                self._hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        else:
            self._tok = self._load_json(path)
        self._eod = self._find_eod()

    @staticmethod
    def _load_json(path: str):
        try:
            from tokenizers import Tokenizer  # noqa: PLC0415 - optional dependency
        except ImportError:
            raise ImportError("HuggingFaceTokenizer needs `pip install tokenizers` (or `pip install -e .[hf]`)") \
                from None
        if not os.path.isfile(path):
            raise FileNotFoundError(f"HuggingFaceTokenizer: {path} not found")
        try:
            return Tokenizer.from_file(path)
        except Exception as exc:  # the Rust side raises a bare Exception
            raise ValueError(f"{path}: not a valid tokenizer.json ({exc})") from None

    def _token_id(self, token: str) -> Optional[int]:
        if self._hf is not None:
            ident = self._hf.convert_tokens_to_ids(token)
            return None if ident is None or ident == self._hf.unk_token_id else int(ident)
        ident = self._tok.token_to_id(token)
        return None if ident is None else int(ident)

    def _find_eod(self) -> int:
        if self._hf is not None and self._hf.eos_token_id is not None:
            return int(self._hf.eos_token_id)
        for token in _EOD_CANDIDATES:
            ident = self._token_id(token)
            if ident is not None:
                return ident
        raise ValueError(f"{self.path}: tokenizer has no end-of-document token (tried eos, {', '.join(_EOD_CANDIDATES)})")

    @property
    def vocab_size(self) -> int:
        if self._hf is not None:
            return len(self._hf)
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def bos(self) -> Optional[int]:
        if self._hf is not None:
            return None if self._hf.bos_token_id is None else int(self._hf.bos_token_id)
        return None

    def tokenize(self, text: str) -> List[int]:
        if self._hf is not None:
            return list(self._hf.encode(text, add_special_tokens=False))
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def detokenize(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self._hf is not None:
            return self._hf.decode(ids)
        return self._tok.decode(ids, skip_special_tokens=False)
