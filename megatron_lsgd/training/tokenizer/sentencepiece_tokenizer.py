"""SentencePiece tokenizers (`--tokenizer-model model.model`).

SentencePieceTokenizer follows Megatron's id layout so datasets preprocessed by Megatron
read back with the same ids: the model's pieces keep their ids, then the special tokens
<CLS> <SEP> <EOD> <MASK> (and <PAD>/<BOS>/<EOS> where the model defines none) are appended
after them, in that order, unless the model already has a piece of that name. EOD is the
appended <EOD>. GPTSentencePieceTokenizer adds nothing and uses the model's </s> as EOD.
"""

from __future__ import annotations

import os
import re
from typing import Dict, List, Optional, Sequence

from .base import AbstractTokenizer


def _load_processor(model_path: str):
    import sentencepiece as spm  # noqa: PLC0415 - heavy import kept local

    if not os.path.isfile(model_path):
        raise FileNotFoundError(f"sentencepiece model not found: {model_path}")
    processor = spm.SentencePieceProcessor()
    try:
        processor.Load(model_path)
    except (OSError, RuntimeError) as exc:
        raise ValueError(f"{model_path}: not a valid sentencepiece model ({exc})") from None
    return processor


class GPTSentencePieceTokenizer(AbstractTokenizer):
    name = "GPTSentencePieceTokenizer"

    def __init__(self, model_path: str):
        self.model_path = model_path
        self._sp = _load_processor(model_path)
        if self._sp.eos_id() < 0:
            raise ValueError(f"{model_path}: the model defines no </s> (eos) piece to use as end of document")

    @property
    def vocab_size(self) -> int:
        return int(self._sp.vocab_size())

    @property
    def eod(self) -> int:
        return int(self._sp.eos_id())

    @property
    def bos(self) -> Optional[int]:
        return int(self._sp.bos_id()) if self._sp.bos_id() >= 0 else None

    def tokenize(self, text: str) -> List[int]:
        return list(self._sp.EncodeAsIds(text))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.DecodeIds([int(i) for i in ids])


class SentencePieceTokenizer(AbstractTokenizer):
    name = "SentencePieceTokenizer"

    def __init__(self, model_path: str):
        self.model_path = model_path
        self._sp = _load_processor(model_path)
        base = int(self._sp.vocab_size())
        self._pieces: Dict[str, int] = {self._sp.IdToPiece(i): i for i in range(base)}
        self._extra: Dict[str, int] = {}  # appended specials: text -> id
        for token in ("<CLS>", "<SEP>", "<EOD>", "<MASK>"):
            self._add_special(token)
        for getter, fallback in ((self._sp.pad_id, "<PAD>"), (self._sp.bos_id, "<BOS>"), (self._sp.eos_id, "<EOS>")):
            ident = getter()
            self._add_special(self._sp.IdToPiece(ident) if 0 <= ident < base else fallback)
        self._vocab_size = base + len(self._extra)
        self._eod = self._special_id("<EOD>")
        bos = self._sp.bos_id()
        self._bos = bos if 0 <= bos < base else self._special_id("<BOS>")
        self._id_to_extra = {v: k for k, v in self._extra.items()}
        # Appended specials written literally in the text map to their ids (Megatron does the same).
        self._special_re = re.compile("|".join(re.escape(t) for t in sorted(self._extra, key=len, reverse=True)))

    def _add_special(self, token: str) -> None:
        if token not in self._pieces and token not in self._extra:
            self._extra[token] = int(self._sp.vocab_size()) + len(self._extra)

    def _special_id(self, token: str) -> int:
        return self._extra[token] if token in self._extra else self._pieces[token]

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def bos(self) -> Optional[int]:
        return self._bos

    def tokenize(self, text: str) -> List[int]:
        ids: List[int] = []
        start = 0
        for match in self._special_re.finditer(text):
            if match.start() > start:
                ids.extend(self._sp.EncodeAsIds(text[start:match.start()]))
            ids.append(self._extra[match.group(0)])
            start = match.end()
        if start < len(text):
            ids.extend(self._sp.EncodeAsIds(text[start:]))
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        parts: List[str] = []
        run: List[int] = []
        for i in ids:
            i = int(i)
            if i in self._id_to_extra:
                if run:
                    parts.append(self._sp.DecodeIds(run))
                    run = []
                parts.append(self._id_to_extra[i])
            else:
                run.append(i)
        if run:
            parts.append(self._sp.DecodeIds(run))
        return "".join(parts)
