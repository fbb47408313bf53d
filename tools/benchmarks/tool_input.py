"""A benchmark tool's input that is damaged or describes something impossible (a truncated
cache file, a field of the wrong kind), or an output it cannot write (a full disk), ends the
tool with one `error:` line naming the file and what is wrong (`tool_errors`, exit 2), not a
traceback."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from typing import Iterator

from megatron_lsgd.core.output_files import WriteError


class ToolInputError(ValueError):
    """An input file of a tool is damaged; the message names the file and the field."""


def read_json_object(path: str, what: str, fix: str) -> dict:
    """The JSON object in `path` (a `what`); damage names the file, the place and `fix`."""
    try:
        with open(path) as f:
            value = json.load(f)
    except json.JSONDecodeError as err:
        raise ToolInputError(f"{what} {path} is damaged (line {err.lineno}, column {err.colno}: {err.msg}); "
                             f"{fix}") from None
    except UnicodeDecodeError as err:
        raise ToolInputError(f"{what} {path} is damaged (not UTF-8 text: {err.reason}); {fix}") from None
    if not isinstance(value, dict):
        raise ToolInputError(f"{what} {path} holds a JSON {type(value).__name__}, not an object; {fix}")
    return value


@contextmanager
def tool_errors() -> Iterator[None]:
    """A tool's main: a damaged input or a failed write is one `error:` line, exit 2."""
    try:
        yield
    except (ToolInputError, WriteError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
