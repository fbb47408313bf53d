"""Reading JSONL corpora (plain or .gz) with file:line positions for every bad line.

Lines are read as bytes and decoded one by one (in the tokenizer workers), so a line that
is not UTF-8 is one bad line with its position, not the end of the run; a truncated or
corrupt .gz file stops with the file name and the last line read.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from dataclasses import dataclass
from typing import IO, Iterator, List, Optional, Sequence, Union


class JsonlError(ValueError):
    """A bad JSONL line under --strict, or an unreadable input; the message names the file."""


def open_binary(path: str) -> IO[bytes]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"input file not found: {path}")
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


@dataclass
class ParsedLine:
    lineno: int
    texts: Optional[List[str]]  # one text per requested key; None when the line is bad
    error: Optional[str] = None


def parse_line(line: Union[str, bytes], keys: Sequence[str], lineno: int, path: str) -> ParsedLine:
    """Parse one JSONL line; a bad line gets `error` set to a `file:line: reason` message."""
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            return ParsedLine(lineno, None, f"{path}:{lineno}: not valid UTF-8 (byte 0x{line[exc.start]:02x} at "
                                            f"column {exc.start + 1})")
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


def _lines(path: str) -> Iterator[bytes]:
    """The file's lines as bytes; a truncated or corrupt .gz is a JsonlError naming the file."""
    count = 0
    with open_binary(path) as f:
        try:
            for line in f:
                count += 1
                yield line
        except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
            raise JsonlError(f"{path}: truncated or corrupt gzip data after line {count} ({exc}); "
                             f"re-create or re-download the file") from None


def iter_lines(path: str, start: int = 0, stop: Optional[int] = None) -> Iterator[tuple]:
    """(1-based line number, line as bytes) for lines [start, stop) of the file, blank lines
    skipped. `parse_line` decodes."""
    for index, line in enumerate(_lines(path)):
        if index < start:
            continue
        if stop is not None and index >= stop:
            break
        if line.strip():
            yield index + 1, line


def count_lines(path: str) -> int:
    return sum(1 for _ in _lines(path))
