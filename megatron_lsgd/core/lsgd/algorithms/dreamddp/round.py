"""A DreamDDP period as one round of the site membership (membership.py).

A round is the steps of one period (H, or fewer where a schedule switch, a checkpoint or
the end of training cuts it), its quorum at its first step. Its "reduction" is many
collectives issued as the backward passes of its steps reach them (each unit's in-place
average), plus the schedule's own probes and agreements: each runs `within` the round, so
a failure is reported, not raised, and nothing more is sent once the round has failed.
Every average is waited for in its own step, so nothing is left to wait for when the round
is decided (its ticket's work is `Finished`).

`RoundUndo` is what a round that does not commit puts back. The averages are in place, so
the values they overwrite are copied just before (`keep`), at most once per unit and round;
a plain run's membership never asks for the undo state, so it keeps no copy.
"""

from __future__ import annotations

import copy
from typing import Dict, Optional

# What the schedule keeps that a round changes: the agreed profile and plan (a switch), the
# period's origin, when each unit was last averaged, the profiling counters and samples, and
# the digests of the last averages (--lsgd-ft-digests).
SCHEDULE = ("profile", "plan", "origin", "deadlines", "profile_steps_done", "samples", "monitor", "monitor_exposed_s",
            "monitor_steps", "reprofiles", "local_measurement", "averaged_digests")


class RoundUndo:
    """state_dict: called when the round is issued by a membership whose rounds may fail; it
    snapshots the schedule and arms `keep`. load_state_dict: the round was not committed, so
    every unit its schedule reached (the average landed, failed or was not sent: a site's ranks
    may fail at different collectives, and must undo the same units) goes back to its value
    just before its first average of the round
    (the local steps it took from the averaged value go with it, as a lost diloco round's
    local steps do), and the schedule's state to what it was at the round's start."""

    def __init__(self, sync):
        self.sync = sync
        self.copies: Optional[Dict[str, tuple]] = None  # None: no undo asked for (nothing kept)

    def keep(self, name: str, mine, whole) -> None:
        """Before `mine` (this rank's part of unit `name`, whose site-wide views are `whole`)
        is averaged in place: its first average of the round keeps a copy."""
        if self.copies is not None and name not in self.copies:
            self.copies[name] = ([m.detach().clone() for m in mine.main], mine, whole)

    def release(self) -> None:
        self.copies = None

    def state_dict(self) -> Dict:
        self.copies = {}
        return {k: copy.deepcopy(getattr(self.sync, k)) for k in SCHEDULE}

    def load_state_dict(self, state: Dict) -> None:
        for k in SCHEDULE:
            setattr(self.sync, k, state[k])
        kept, self.copies = self.copies or {}, None
        for saved, mine, _ in kept.values():
            for main, value in zip(mine.main, saved):
                main.copy_(value)
        # every rank of the site restores the same units (the schedule's, whatever failed where),
        # so the site's gathers below match
        self.sync.publish(kept)


class RoundComm:
    """The inter-site comm as the schedule's probes and agreements see it inside a round:
    each blocking collective runs `within` the round (profile.probe_link, agree_max)."""

    def __init__(self, comm, membership, ticket):
        self.comm, self.membership, self.ticket = comm, membership, ticket

    @property
    def clock(self):
        return self.comm.clock

    def on_group(self, group):
        return self.comm.on_group(group)

    def all_reduce_mean(self, tensor, async_op: bool = False) -> None:
        assert not async_op, "the round's probes are blocking"
        self.membership.within(self.ticket, lambda: self.comm.all_reduce_mean(tensor))

    def all_reduce_max(self, tensor) -> None:
        self.membership.within(self.ticket, lambda: self.comm.all_reduce_max(tensor))
