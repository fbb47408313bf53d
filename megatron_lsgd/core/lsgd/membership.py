"""Which sites take part in an outer round, and whether the round is kept.

A local-SGD round is framed by two calls:
- `round_started()` before its first inner step: a fault-tolerant membership takes its
  quorum here (who is up), and a site that comes back receives a live peer's state;
- `reduce(mean, undo)` at its end: runs the cross-site mean and returns it when the round
  is committed, or None when it is not (a site failed mid-round). The caller then leaves
  its anchor as it was and restarts from it; `undo` (objects with state_dict /
  load_state_dict, e.g. the compressor's error feedback) is put back as it was before.

The training loop's own few cross-site numbers (a log line's losses, sample counts) go
through it too (`mean_over_sites`, `sum_over_sites`): over the sites of the round, and
never raising for a site that is gone.

`AllSites`, the default, is the fixed set of sites of a plain run: every round commits
and it adds no arithmetic, so runs without fault tolerance are unchanged.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


class SiteMembership:
    def round_started(self) -> None:
        """Before the first inner step of a round."""

    def reduce(self, mean: Callable[[], T], undo: Sequence[object] = ()) -> Optional[T]:
        """The round's cross-site mean if the round commits, else None (state in `undo` restored)."""
        raise NotImplementedError

    def mean_over_sites(self, tensor: torch.Tensor) -> None:
        """`tensor` (a few values of the loop's) becomes its mean over the round's sites, in place."""
        raise NotImplementedError

    def sum_over_sites(self, tensor: torch.Tensor) -> None:
        """`tensor` becomes its sum over the round's sites, in place."""
        raise NotImplementedError

    def state_dict(self) -> Dict:
        """What a checkpoint keeps of the membership (a fault-tolerant one: the committed rounds)."""
        return {}

    def load_state_dict(self, state: Dict) -> None:
        pass

    def close(self) -> None:
        """The run is over (a fault-tolerant membership leaves its quorum)."""


class AllSites(SiteMembership):
    """Every configured site, every round (a failure ends the run with an error line).
    `group`: the rank's dp_inter group, over which the loop's values are reduced, through
    `devices` (an InterSiteDevices: checked against the group's device, copied there when
    needed) when given."""

    def __init__(self, group=None, num_sites: int = 1, devices=None):
        self.group, self.num_sites, self.devices = group, num_sites, devices

    def reduce(self, mean: Callable[[], T], undo: Sequence[object] = ()) -> Optional[T]:
        return mean()

    def mean_over_sites(self, tensor: torch.Tensor) -> None:
        if self.num_sites > 1:
            tensor.div_(self.num_sites)
            self._all_reduce("the loop's mean over sites", tensor)

    def sum_over_sites(self, tensor: torch.Tensor) -> None:
        if self.num_sites > 1:
            self._all_reduce("the loop's sum over sites", tensor)

    def _all_reduce(self, what: str, tensor: torch.Tensor) -> None:
        if self.devices is None:
            dist.all_reduce(tensor, group=self.group)
        else:
            self.devices.all_reduce(what, tensor, self.group)
