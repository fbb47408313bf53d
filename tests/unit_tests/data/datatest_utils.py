"""Helpers shared by the data-pipeline tests (imported by module name: tests have no packages)."""

from __future__ import annotations

import os
import sys
from typing import List, Sequence

import numpy as np

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
TOOLS_DIR = os.path.join(REPO_ROOT, "tools")
CORPUS_DIR = os.path.join(REPO_ROOT, "data", "python-docs")
SP_MODEL = os.path.join(CORPUS_DIR, "python_docs_sp8k.model")
CORPUS_PREFIX = os.path.join(CORPUS_DIR, "python_docs_text_document")
CORPUS_JSONL = os.path.join(CORPUS_DIR, "python-docs-3.11-slice.jsonl.gz")

if TOOLS_DIR not in sys.path:  # the tools are scripts; tests import them as modules
    sys.path.insert(0, TOOLS_DIR)


def write_dataset(prefix: str, docs: Sequence[Sequence[int]], dtype=np.uint16) -> str:
    from megatron_lsgd.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype)
    for doc in docs:
        builder.add_document(np.asarray(doc, dtype=dtype))
    builder.finalize(prefix + ".idx")
    return prefix


def random_docs(rng: np.random.Generator, n: int, vocab: int, eod: int, max_len: int = 60) -> List[List[int]]:
    """Documents of random length, each ending with eod (as --append-eod writes them)."""
    docs = []
    for _ in range(n):
        length = int(rng.integers(1, max_len))
        docs.append(rng.integers(0, eod, size=length).tolist() + [eod])
    return docs
