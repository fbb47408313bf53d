"""`--json-log PATH`: one JSON object per line, written by the logging rank, so benchmarks
read numbers instead of parsing the human log line."""

from __future__ import annotations

import json
import os
from typing import Optional


class JsonLog:
    def __init__(self, path: Optional[str], enabled: bool):
        self._file = None
        if path and enabled:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record, sort_keys=True) + "\n")
            self._file.flush()  # a killed run still leaves every interval it finished

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
