"""`--json-log PATH`: one JSON object per line, written by the logging rank, so benchmarks
read numbers instead of parsing the human log line."""

from __future__ import annotations

import json
import os
from typing import Optional

from megatron_lsgd.core.output_files import write_error


class JsonLog:
    """A failed write (a full disk) raises WriteError naming --json-log; the lines already
    written stay (the file is appended to, so it is never removed)."""

    def __init__(self, path: Optional[str], enabled: bool):
        self._file = None
        self._path = path
        if path and enabled:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                self._file = open(path, "a", encoding="utf-8")
            except OSError as err:
                raise self._error(err) from None

    def _error(self, err: OSError):
        return write_error(err, f"--json-log {self._path}")

    def write(self, record: dict) -> None:
        if self._file is not None:
            try:
                self._file.write(json.dumps(record, sort_keys=True) + "\n")
                self._file.flush()  # a killed run still leaves every interval it finished
            except OSError as err:
                self.abandon()
                raise self._error(err) from None

    def abandon(self) -> None:
        """Stop writing without flushing what is buffered (it failed once already)."""
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass

    def close(self) -> None:
        if self._file is not None:
            f, self._file = self._file, None
            try:
                f.close()
            except OSError as err:
                raise self._error(err) from None
