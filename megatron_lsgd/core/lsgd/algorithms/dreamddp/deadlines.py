"""Every sync unit averaged at least once in any H consecutive iterations, across a switch
of schedules.

A schedule gives each unit at least one slot per period, so while one schedule runs no
unit goes more than H iterations without an average. A switch starts a new period whose
slots need not line up with the old one's: the profiled schedule replacing the
equal-number one after the profiling steps, a re-profile, a resume with another H. A unit
the profiling steps never reached would then wait up to profile steps + H - 1 iterations,
one the old schedule averaged early in its period and the new one late up to 2H - 1.

`Deadlines` remembers when each unit was last averaged and names the units whose H
iterations are up; they are averaged in that iteration besides the slot's own units.
While one schedule runs, they are always among the slot's units already, so the steady
state averages nothing extra; extra averages fall in the first period after a switch.
Pure Python, deterministic: every rank of a dp_inter group names the same units.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Sequence


class Deadlines:
    def __init__(self, names: Sequence[str], start: int):
        """`names`: this stage's units; `start`: the first iteration of local training (the
        sites' models are the same before it: same initialization, then warm-up)."""
        self.last: Dict[str, int] = {n: start - 1 for n in names}

    def overdue(self, iteration: int, interval: int) -> List[str]:
        """The units that must be averaged in `iteration`: H iterations since their last average."""
        return [n for n, t in self.last.items() if iteration - t >= interval]

    def with_overdue(self, planned: Sequence[str], iteration: int, interval: int) -> List[str]:
        """What to average in `iteration`: the slot's `planned` units, then the overdue ones it lacks."""
        return list(planned) + [n for n in self.overdue(iteration, interval) if n not in planned]

    def averaged(self, iteration: int, names: Iterable[str]) -> None:
        for n in names:
            if n in self.last:
                self.last[n] = iteration

    @classmethod
    def of_steady_schedule(cls, names: Sequence[str], slots: Sequence[Sequence[str]], origin: int,
                           iteration: int) -> "Deadlines":
        """What a schedule (`slots`, periods from `origin`) that has run alone until
        `iteration` averaged last: for checkpoints written before deadlines were kept."""
        out = cls(names, origin)
        interval = len(slots)
        for n in names:
            for t in range(iteration - 1, max(origin, iteration - interval) - 1, -1):
                if n in slots[(t - origin) % interval]:
                    out.last[n] = t
                    break
        return out

    def state_dict(self) -> Dict[str, int]:
        return dict(self.last)

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.last.update({str(n): int(t) for n, t in state.items() if n in self.last})
