"""Reading JSONL corpora (plain or .gz) with file:line positions for every bad line."""

from __future__ import annotations

import gzip
import io
import json
import os
from dataclasses import dataclass
from typing import IO, Iterator, List, Optional, Sequence


class JsonlError(ValueError):
    """A bad JSONL line under --strict; the message is `file:line: reason`."""


def open_text(path: str) -> IO[str]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"input file not found: {path}")
    if path.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


@dataclass
class ParsedLine:
    lineno: int
    texts: Optional[List[str]]  # one text per requested key; None when the line is bad
    error: Optional[str] = None


def parse_line(line: str, keys: Sequence[str], lineno: int, path: str) -> ParsedLine:
    """Parse one JSONL line; a bad line gets `error` set to a `file:line: reason` message."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        return ParsedLine(lineno, None, f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno})")
    if not isinstance(obj, dict):
        return ParsedLine(lineno, None, f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
    texts = []
    for key in keys:
        if key not in obj:
            return ParsedLine(lineno, None, f"{path}:{lineno}: missing key {key!r} (has {sorted(obj)[:8]})")
        value = obj[key]
        if not isinstance(value, str):
            return ParsedLine(lineno, None, f"{path}:{lineno}: key {key!r} is {type(value).__name__}, not a string")
        texts.append(value)
    return ParsedLine(lineno, texts)


def iter_lines(path: str, start: int = 0, stop: Optional[int] = None) -> Iterator[tuple]:
    """(1-based line number, line) for lines [start, stop) of the file, blank lines skipped."""
    with open_text(path) as f:
        for index, line in enumerate(f):
            if index < start:
                continue
            if stop is not None and index >= stop:
                break
            if line.strip():
                yield index + 1, line


def count_lines(path: str) -> int:
    with open_text(path) as f:
        return sum(1 for _ in f)
