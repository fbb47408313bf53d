"""Which sites take part in an outer round, and whether the round is kept.

A local-SGD round is framed by two calls:
- `round_started()` before its first inner step: a fault-tolerant membership takes its
  quorum here (who is up), and a site that comes back receives a live peer's state;
- `reduce(mean, undo)` at its end: runs the cross-site mean and returns it when the round
  is committed, or None when it is not (a site failed mid-round). The caller then leaves
  its anchor as it was and restarts from it; `undo` (objects with state_dict /
  load_state_dict, e.g. the compressor's error feedback) is put back as it was before.

A reduction that overlaps inner steps (dilocox's one-round-late mean, a streaming
fragment) is split in two: `start(issue, undo)` issues it and returns a ticket (poll it
between steps; `wait` lets it land without deciding), `finish(ticket)` waits and returns
the mean, or None when the round is not committed. Under a fault-tolerant membership
(`elastic`) a round is one quorum, at most one reduction and one decision: a synchronizer
takes the quorum (`round_started`) at the start of a step, issues right after it, and
finishes before its next quorum.

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


class JobFinished(Exception):
    """Raised in a site that received the job's final state from a peer (it missed the job's
    last rounds): training is over, the state it holds is the job's final one."""


class SiteMembership:
    # Rounds may fail and sites may join: a round's quorum is taken at the start of a step
    # (where a returning site is healed), its reduction issued right after it.
    elastic = False

    def round_started(self) -> None:
        """Before the first inner step of a round."""

    def reduce(self, mean: Callable[[], T], undo: Sequence[object] = ()) -> Optional[T]:
        """The round's cross-site mean if the round commits, else None (state in `undo` restored)."""
        return self.finish(self.start(lambda: Finished(mean()), undo))

    def start(self, issue: Callable[[], object], undo: Sequence[object] = ()):
        """Issue the round's reduction: `issue()` returns work with `poll()`, `wait()`, `done`
        and `result` (a PendingReduce); the returned ticket has the same four."""
        raise NotImplementedError

    def finish(self, ticket) -> Optional[object]:
        """Wait for the ticket's reduction and decide: its result if the round commits, else
        None (the `undo` state put back as it was when it was issued)."""
        raise NotImplementedError

    def job_finished(self) -> None:
        """The job reached its budget: a fault-tolerant membership takes a last quorum, in
        which a site that missed the end receives the final state (and a site behind it)."""

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

    def start(self, issue: Callable[[], object], undo: Sequence[object] = ()):
        return issue()  # the work itself: nothing to undo, every round commits

    def finish(self, ticket) -> Optional[object]:
        return ticket.wait()

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


class UnequalSites(AllSites):
    """Every site, every round, when sites have different data-parallel sizes
    (--site-data-parallel-sizes). A rank may then hold several dp_inter lanes, so the loop's
    values go over `group` = the rank's `dp` group (every replica of its (tp, pp) on every
    site), where each value is already the same on all replicas of a site: only the site's
    first replica (`lead`) contributes, scaled by `weight` (the site's share of the round's
    tokens) for a mean and unscaled for a sum. The mean is thus weighted by tokens, as the
    synchronizers' means are."""

    def __init__(self, group, num_sites: int, devices, lead: bool, weight: float):
        super().__init__(group, num_sites, devices)
        self.lead, self.weight = lead, weight

    def mean_over_sites(self, tensor: torch.Tensor) -> None:
        tensor.mul_(self.weight) if self.lead else tensor.zero_()
        self._all_reduce("the loop's mean over sites", tensor)

    def sum_over_sites(self, tensor: torch.Tensor) -> None:
        if not self.lead:
            tensor.zero_()
        self._all_reduce("the loop's sum over sites", tensor)


class MixedLayoutSites(UnequalSites):
    """Every site, every round, when sites have different TP x PP layouts
    (--site-tensor/pipeline-model-parallel-sizes): no group joins one (tp, pp) coordinate
    across sites. The loop's means (called on the last pipeline stage) go over `group` =
    every site's last-stage ranks, the site's first of them (`lead`) contributing, scaled by
    `weight`; its sums (called on every rank) over `world` (None: the default group), the
    site's first rank (`world_lead`) contributing. Both groups have the world's backend and
    take the run's device tensors the loop passes, so no device change is needed."""

    def __init__(self, group, num_sites: int, lead: bool, weight: float, world, world_lead: bool):
        super().__init__(group, num_sites, None, lead, weight)
        self.world, self.world_lead = world, world_lead

    def sum_over_sites(self, tensor: torch.Tensor) -> None:
        if not self.world_lead:
            tensor.zero_()
        dist.all_reduce(tensor, group=self.world)


class Finished:
    """Work that is already done (a blocking reduction's result, seen as a ticket's work)."""

    done = True

    def __init__(self, result):
        self.result = result

    def poll(self) -> bool:
        return True

    def wait(self):
        return self.result
