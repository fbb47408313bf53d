"""Fragments: which sync units are synchronized together.

Sync units are named `embedding`, `layers.<i>` (global layer index) and `output` (final
norm + output layer), whichever pipeline stage holds them. A partition into K fragments
is computed from the global layer count alone, so every rank of every stage and site
agrees on it without talking:

- sequential: layers in K contiguous blocks whose sizes differ by at most one (the
  earlier blocks take the extra layers);
- strided: layer i belongs to fragment i mod K (each fragment spans the whole depth, as
  in Streaming DiLoCo's and CoCoDC's experiments).

The embedding joins the fragment of layer 0 and the output head that of the last layer,
except with tied embeddings, where the head joins the embedding's fragment: the last
stage's copy of the word embedding must be synchronized together with the first stage's,
or the two copies of one matrix would drift apart.
"""

from __future__ import annotations

from typing import List, Sequence

PARTITIONS = ("sequential", "strided")


def fragment_of(unit_name: str, num_layers: int, num_fragments: int, mode: str, tied_embeddings: bool) -> int:
    if num_fragments < 1 or num_fragments > num_layers:
        raise ValueError(f"{num_fragments} fragments for {num_layers} layers: need 1 <= fragments <= layers")
    if mode not in PARTITIONS:
        raise ValueError(f"fragment partition {mode!r}: choose one of {', '.join(PARTITIONS)}")
    if unit_name == "embedding":
        layer = 0
    elif unit_name == "output":
        layer = 0 if tied_embeddings else num_layers - 1
    elif unit_name.startswith("layers."):
        layer = int(unit_name.split(".", 1)[1])
    else:
        raise ValueError(f"unknown sync unit {unit_name!r}")
    if mode == "strided":
        return layer % num_fragments
    base, extra = divmod(num_layers, num_fragments)  # the first `extra` blocks hold base + 1 layers
    boundary = extra * (base + 1)
    return layer // (base + 1) if layer < boundary else extra + (layer - boundary) // base


def partition(units: Sequence, num_layers: int, num_fragments: int, mode: str, tied_embeddings: bool) -> List[list]:
    """This stage's units grouped by fragment: K lists (some may be empty on this stage)."""
    out: List[list] = [[] for _ in range(num_fragments)]
    for unit in units:
        out[fragment_of(unit.name, num_layers, num_fragments, mode, tied_embeddings)].append(unit)
    return out
