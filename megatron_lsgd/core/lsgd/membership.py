"""Which sites take part in an outer round, whether the round is kept, and when a reduction
is issued.

A local-SGD round is framed by two calls (for `sync` a round is one step):
- `round_started()` before its first inner step: a fault-tolerant membership takes its
  quorum here (who is up), and a site that comes back receives a live peer's state (it
  returns that `Heal`);
- `reduce(mean, undo)` at its end: runs the cross-site mean and returns it when the round
  is committed, or None when it is not (a site failed mid-round). The caller then leaves
  its anchor as it was and restarts from it; `undo` (objects with state_dict /
  load_state_dict, e.g. the compressor's error feedback) is put back as it was before.

A reduction that overlaps inner steps (dilocox's one-round-late mean, a streaming
fragment) is split in two: `start(issue, undo)` issues it and returns a ticket (poll it
between steps; `wait` lets it land without deciding), `finish(ticket)` waits and returns
the mean, or None when the round is not committed.
A round whose reduction is many collectives issued later, as compute reaches them (edit's
norm gather, then a unit's exchange just before the unit's forward), runs each of them
through `within(ticket, call)`: a collective that fails is reported (the round will not
commit) instead of raised, and once the round has failed nothing more is sent. The rows of
a gather are the round's sites in `round_sites()` order.

Where such a reduction is issued, and how training ends, is the membership's rhythm: the
same calls whatever the membership (the synchronizer implements `Exchanges` and never asks
which membership it has):
- `taken(ex)`, right after a step took a reduction (its Δ): `AllSites` issues it at once;
  an elastic membership (a round is one quorum, at most one reduction and one decision)
  after the next step's quorum, where a returning site is healed;
- `step_started(ex)`, at every step's start: `AllSites` does nothing; an elastic membership
  takes a quorum per reduction due and issues each right after its quorum (and a quorum at
  the process's first step), deciding what is open before each quorum;
- `close_exchanges(ex)`, the end of training (finish_training), written once here: what is
  in flight lands, then each closing exchange is a round of its own until none is left.

A site whose training is over because of a heal (it received the job's final state, or was
healed into the closing exchanges and finished them with the others) says so in
`ended_by`; the synchronizer's step then ends training through the protocol
(`Synchronizer.ended`, `StepResult.ended`), not by an exception.

The training loop's own few cross-site numbers (a log line's losses, sample counts) go
through it too (`mean_over_sites`, `sum_over_sites`): over the sites of the round, and
never raising for a site that is gone.

`AllSites`, the default, is the fixed set of sites of a plain run: every round commits,
every reduction is issued where it is taken, and it adds no arithmetic, so runs without
fault tolerance are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Protocol, Sequence, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


@dataclass(frozen=True)
class Heal:
    """A live peer's state, received at a quorum (torchft heals a site whose committed rounds
    are behind the quorum's): the site now holds that peer's state (model, optimizer,
    synchronizer, data position) and counts rounds as it does."""

    committed_round: int  # the job's committed rounds at the quorum (the peer's count, now this site's)
    # The peer had finished the job (it served its state at its closing quorum): what the site
    # holds is the job's final state, and its training is over.
    final: bool = False
    # The peer was in the job's closing exchanges: the site took part in the rest of them
    # with the others, and its training is over (it still takes the job's closing quorum).
    joined_closing: bool = False
    closing_quorum: bool = False  # received at this site's own closing quorum (job_finished), after training

    @property
    def ends_training(self) -> bool:
        return self.final or self.joined_closing

    def reason(self) -> str:
        if self.final:
            return f"healed to the job's final state at committed round {self.committed_round}"
        return (f"healed into the job's closing exchanges at committed round {self.committed_round}, "
                f"which are now done")


class Exchanges(Protocol):
    """A synchronizer whose cross-site reductions overlap inner steps (dilocox's one-round-late
    mean; streaming-diloco's and cocodc's fragment syncs), as the membership's rhythm drives
    it. What it keeps for this (what is due, `finishing`) is in its state_dict, so a
    checkpoint and a heal carry it: a site healed into a peer's closing exchanges holds
    `finishing` and the exchanges left."""

    finishing: bool  # the closing exchanges (close_exchanges) are under way

    def exchange_due(self) -> bool:
        """A reduction was taken (after a step) and waits to be issued."""

    def issue_due(self) -> None:
        """Issue the next reduction due (one), through `membership.start`."""

    def decide_open(self) -> None:
        """Decide (`membership.finish`) what is in flight: no reduction may be open when a
        quorum rebuilds the group."""

    def land_in_flight(self) -> None:
        """The end of training (close_exchanges), first: every reduction in flight lands (or
        is rolled back)."""

    def closing_due(self) -> bool:
        """A closing exchange is left (a reduction due, progress not yet exchanged)."""

    def close_one(self) -> None:
        """One closing exchange, a round of its own: issue it and decide it."""

    def closed(self) -> None:
        """After the last closing exchange (dilocox loads the anchor)."""


class SiteMembership:
    # The heal after which this site's training is over (None: it is not); see Heal.ends_training.
    ended_by: Optional[Heal] = None
    # Whether this process has taken part in a round: a fixed set of sites always has; an
    # elastic one from its first quorum, where a restarted site is healed (a synchronizer
    # that takes quorums only where its sites meet, a-edit, takes that one itself).
    joined: bool = True

    def round_started(self) -> Optional[Heal]:
        """Before the first inner step of a round; the heal it brought, if any."""
        return None

    def reduce(self, mean: Callable[[], T], undo: Sequence[object] = ()) -> Optional[T]:
        """The round's cross-site mean if the round commits, else None (state in `undo` restored)."""
        return self.finish(self.start(lambda: Finished(mean()), undo))

    def start(self, issue: Callable[[], object], undo: Sequence[object] = ()):
        """Issue the round's reduction: `issue()` returns work with `poll()`, `wait()`, `done`
        and `result` (a PendingReduce); the returned ticket has the same four."""
        raise NotImplementedError

    def finish(self, ticket) -> Optional[object]:
        """Wait for the ticket's reduction and decide: its result if the round commits, else
        None (the `undo` state put back as it was when it was issued). Deciding twice gives
        the first decision."""
        raise NotImplementedError

    def within(self, ticket, call: Callable[[], T], failed: Optional[T] = None) -> Optional[T]:
        """`call()`, a later collective of the ticket's round (see the module docstring): its
        result, or `failed` when it fails or the round already has (an elastic membership)."""
        return call()

    def round_sites(self) -> Sequence[int]:
        """The round's sites in the order of the cross-site group's ranks (a gather's rows)."""
        raise NotImplementedError

    # ---- the rhythm of reductions that overlap inner steps (Exchanges) ---------------------------
    def taken(self, ex: Exchanges) -> None:
        """A step took a reduction (`ex.exchange_due()`): a fixed set of sites issues it now."""
        while ex.exchange_due():
            ex.issue_due()

    def step_started(self, ex: Exchanges) -> None:
        """At every inner step's start (before its forward pass): nothing to do for a fixed set
        of sites; an elastic membership takes its quorums here."""

    def close_exchanges(self, ex: Exchanges, quorum_taken: bool = False) -> None:
        """The end of training, for every synchronizer whose reductions overlap inner steps and
        every membership: what is in flight lands, then each closing exchange is a round of
        its own (quorum, reduction, decision) until none is left (one that does not commit
        is tried again), then `ex.closed()`. `quorum_taken`: the first round's quorum is
        already taken (a site healed into a peer's closing exchanges joins in from there).
        A site healed here to the job's final state has nothing left to exchange."""
        ex.finishing = True
        ex.land_in_flight()
        while ex.closing_due():
            if not quorum_taken:
                self.round_started()
                if self.ended_by is not None:  # the job's final state: the exchanges were done without it
                    return
            quorum_taken = False
            ex.close_one()
        ex.finishing = False
        ex.closed()

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

    def round_sites(self) -> Sequence[int]:
        return range(self.num_sites)

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
