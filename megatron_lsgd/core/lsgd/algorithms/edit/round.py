"""An EDiT sync as one round of the site membership (membership.py).

A sync is many collectives issued as compute reaches them (the norm gather, then each
unit's exchange in the forward pass), so the round's "reduction" is the sync itself:
`SyncWork` is done when every unit of the stage has synced, and each collective runs
through `membership.within` (a failure is reported, not raised). `RoundUndo` is what a
round that does not commit puts back: the outer state (anchors, momenta), the penalty's
statistics, the error feedback and the counters as they were when the sync was issued;
then every unit restarts from its anchor, as diloco's sites do after a lost round.
"""

from __future__ import annotations

import copy
from typing import Dict


class SyncWork:
    """The ticket's work: done when the stage's units have all synced; waiting syncs the
    ones left (a sync carried out outside the forward: quiesce, the end of training)."""

    def __init__(self, edit):
        self.edit = edit

    @property
    def done(self) -> bool:
        return not self.edit.pending

    def poll(self) -> bool:
        return self.done

    def wait(self):
        if self.edit.pending:
            self.edit.sync_units()
        return True

    @property
    def result(self):
        return True


COUNTERS = ("syncs", "decisions", "flagged_counts", "rollbacks", "last_min_weight", "last_max_norm", "clipped")


class RoundUndo:
    """state_dict: a snapshot when the sync is issued; load_state_dict: the round was not
    committed, so put it back and restart every unit from its (old) anchor."""

    def __init__(self, edit):
        self.edit = edit

    def state_dict(self) -> Dict:
        e = self.edit
        return {"outer": e.outer.state_dict(), "penalty": copy.deepcopy(e.penalty.state_dict()),
                "compressors": e.bank.state_dict(), **{k: copy.deepcopy(getattr(e, k)) for k in COUNTERS}}

    def load_state_dict(self, state: Dict) -> None:
        e = self.edit
        e.outer.load_state_dict(state["outer"])
        e.penalty.load_state_dict(state["penalty"])
        e.bank.load_state_dict(state["compressors"], e.compressed_views(), e.outer.device)
        for k in COUNTERS:
            setattr(e, k, state[k])
        e.restart_from_anchors()
