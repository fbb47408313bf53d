"""Which sites take part in an outer round, and whether the round is kept.

A local-SGD round is framed by two calls:
- `round_started()` before its first inner step: a fault-tolerant membership takes its
  quorum here (who is up), and a site that comes back receives a live peer's state;
- `reduce(mean, undo)` at its end: runs the cross-site mean and returns it when the round
  is committed, or None when it is not (a site failed mid-round). The caller then leaves
  its anchor as it was and restarts from it; `undo` (objects with state_dict /
  load_state_dict, e.g. the compressor's error feedback) is put back as it was before.

`AllSites`, the default, is the fixed set of sites of a plain run: every round commits
and it adds no arithmetic, so runs without fault tolerance are unchanged.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, TypeVar

T = TypeVar("T")


class SiteMembership:
    def round_started(self) -> None:
        """Before the first inner step of a round."""

    def reduce(self, mean: Callable[[], T], undo: Sequence[object] = ()) -> Optional[T]:
        """The round's cross-site mean if the round commits, else None (state in `undo` restored)."""
        raise NotImplementedError


class AllSites(SiteMembership):
    """Every configured site, every round (a failure ends the run with an error line)."""

    def reduce(self, mean: Callable[[], T], undo: Sequence[object] = ()) -> Optional[T]:
        return mean()
