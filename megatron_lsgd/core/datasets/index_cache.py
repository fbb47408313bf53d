"""On-disk cache of dataset indices, safe when several ranks build the same entry at once.

Each array is written to a temporary file in the cache directory and renamed into place
(atomic on POSIX); the description JSON is renamed last and marks the entry complete.
Building is deterministic, so concurrent writers produce identical files and whichever
rename lands last is equally valid.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Dict, Optional

import numpy as np

from megatron_lsgd.core.output_files import replaced_atomically


def description_hash(description: Dict) -> str:
    text = json.dumps(description, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


class IndexCache:
    def __init__(self, cache_dir: str, description: Dict, names: tuple, label: str = "index"):
        self.dir = cache_dir
        self.label = label
        self.description = description
        self.names = names
        self.key = description_hash(description)

    def _path(self, name: str) -> str:
        return os.path.join(self.dir, f"{self.key}-{self.label}-{name}.npy")

    @property
    def _marker(self) -> str:
        return os.path.join(self.dir, f"{self.key}-{self.label}-description.json")

    def load(self) -> Optional[Dict[str, np.ndarray]]:
        if not os.path.isfile(self._marker):
            return None
        try:
            with open(self._marker, encoding="utf-8") as f:
                if json.load(f) != json.loads(json.dumps(self.description, sort_keys=True)):
                    return None  # hash collision or a foreign file: rebuild
            return {name: np.load(self._path(name), mmap_mode="r", allow_pickle=False) for name in self.names}
        except (OSError, ValueError):
            return None  # partial or damaged entry: rebuild and overwrite

    def _atomic_write(self, final_path: str, write) -> None:
        with replaced_atomically(final_path, durable=True) as tmp:
            with open(tmp, "wb") as f:
                write(f)

    def save(self, arrays: Dict[str, np.ndarray]) -> None:
        os.makedirs(self.dir, exist_ok=True)
        for name in self.names:
            self._atomic_write(self._path(name), lambda f, a=arrays[name]: np.save(f, a, allow_pickle=False))
        payload = json.dumps(self.description, sort_keys=True, indent=1).encode("utf-8")
        self._atomic_write(self._marker, lambda f: f.write(payload))
