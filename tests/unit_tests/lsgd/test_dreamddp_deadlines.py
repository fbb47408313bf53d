"""DreamDDP keeps "every unit averaged at least once in any H consecutive iterations" across
a switch of schedules (deadlines.py), without processes: the selection the synchronizer
makes each iteration (the slot's units, then the overdue ones) is replayed over a switch
from the equal-number schedule of the profiling steps to the profiled one, and over a
re-profile at a period boundary. Each case first shows that the schedules alone leave a
unit unaveraged for longer (up to profile steps + H - 1 iterations), then that with the
deadlines no window of H iterations misses a unit, that the extra averages fall only in
the first period after the switch, and that the steady state is the schedule's own."""

from __future__ import annotations

from typing import Dict, List, Sequence, Set, Tuple

import pytest

from megatron_lsgd.core.lsgd.algorithms.dreamddp.deadlines import Deadlines
from megatron_lsgd.core.lsgd.algorithms.dreamddp.plan import build_plan
from megatron_lsgd.core.lsgd.algorithms.dreamddp.profile import Profile, UnitProfile

FORWARD = ["embedding", "layers.0", "layers.1", "output"]
NAMES = list(reversed(FORWARD))  # backward order, as the synchronizer keeps them
Schedules = List[Tuple[int, Sequence[Sequence[str]]]]  # (origin, slots) from that iteration on


def _slots(profile: Profile, interval: int, method: str, bubble_fill: bool = True) -> List[List[str]]:
    return build_plan(profile, interval, method, bubble_fill).stages[0].slots


def _profiling_slots(interval: int) -> List[List[str]]:  # the synchronizer's schedule while it profiles
    return _slots(_untimed(), interval, "equal", bubble_fill=False)


def _untimed() -> Profile:  # what the synchronizer schedules with while it profiles
    return Profile([UnitProfile(n, 0, 0.0, 0, 0) for n in FORWARD], [0.0], 0.0, 0.0, False)


def _slow_link() -> Profile:  # 1 ms backward per unit, 50 ms per average: nothing hides
    return Profile([UnitProfile(n, 0, 1e-3, 1024, 1) for n in FORWARD], [0.0], 0.05, 1e-9, False)


def replay(schedules: Schedules, interval: int, iterations: int, deadlines: bool) -> List[Set[str]]:
    """What is averaged in each iteration, as DreamDDP._to_average chooses it."""
    kept = Deadlines(NAMES, 0)
    out = []
    for it in range(iterations):
        origin, slots = [s for s in schedules if s[0] <= it][-1]
        planned = list(slots[(it - origin) % interval])
        chosen = kept.with_overdue(planned, it, interval) if deadlines else planned
        kept.averaged(it, chosen)
        out.append(set(chosen))
    return out


def longest_wait(history: List[Set[str]]) -> Dict[str, int]:
    """Per unit, the most consecutive iterations without an average (the models are equal
    before iteration 0)."""
    out = {}
    for n in NAMES:
        times = [-1] + [it for it, units in enumerate(history) if n in units] + [len(history)]
        out[n] = max(b - a - 1 for a, b in zip(times, times[1:]))
    return out


CASES = {
    # 2 profiling steps, then the profiled schedule (here --lsgd-dreamddp-scheduler equal: one
    # unit per slot, as while profiling, but in a new period): embedding's first slot comes
    # profile steps + H - 1 iterations after the start
    "profiling-then-equal": (4, 2, lambda: _slots(_slow_link(), 4, "equal")),
    # 1 profiling step, then the DFS schedule of a slow link: {output}, {layers.1}, {layers.0, embedding}
    "profiling-then-dfs": (3, 1, lambda: _slots(_slow_link(), 3, "dfs")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_switch_from_the_profiling_schedule_keeps_every_unit_within_h(case):
    interval, profile_steps, profiled = CASES[case]
    schedules = [(0, _profiling_slots(interval)), (profile_steps, profiled())]
    iterations = profile_steps + 4 * interval
    plain = replay(schedules, interval, iterations, deadlines=False)
    assert max(longest_wait(plain).values()) == profile_steps + interval - 1  # the gap as filed
    kept = replay(schedules, interval, iterations, deadlines=True)
    assert max(longest_wait(kept).values()) <= interval - 1, longest_wait(kept)  # every H-window averages all
    _check_extras(plain, kept, profile_steps, interval)


def test_a_reprofile_at_a_period_boundary_keeps_every_unit_within_h():
    # layers.0 is averaged in the first slot of the old schedule's last period and in the
    # last slot of the new one's first: 2H - 1 iterations apart without the deadlines
    interval, switch = 3, 6
    old = [["output", "layers.1", "layers.0"], ["embedding"], []]
    new = [["output"], ["layers.1"], ["layers.0", "embedding"]]
    schedules = [(0, old), (switch, new)]
    plain = replay(schedules, interval, switch + 3 * interval, deadlines=False)
    assert longest_wait(plain)["layers.0"] == 2 * interval - 2
    kept = replay(schedules, interval, switch + 3 * interval, deadlines=True)
    assert max(longest_wait(kept).values()) <= interval - 1
    _check_extras(plain, kept, switch, interval)


def _check_extras(plain: List[Set[str]], kept: List[Set[str]], switch: int, interval: int) -> None:
    """Extra averages only in the first period after the switch; the schedule's own units always."""
    for it, (p, k) in enumerate(zip(plain, kept)):
        assert p <= k
        if k != p:
            assert switch <= it < switch + interval, f"iteration {it}: extra {k - p} outside the switch's period"
    assert any(k != p for p, k in zip(plain, kept))


def test_deadlines_state_and_the_schedule_they_follow_from():
    slots = [["output", "layers.1"], ["layers.0"], ["embedding"]]
    steady = replay([(0, slots)], 3, 7, deadlines=True)
    assert steady == [set(s) for s in (slots * 3)[:7]]  # one schedule alone: nothing extra
    # a checkpoint without deadlines: derived from the schedule it ran (iterations 0..6 done)
    derived = Deadlines.of_steady_schedule(NAMES, slots, 0, 7)
    assert derived.last == {"output": 6, "layers.1": 6, "layers.0": 4, "embedding": 5}
    early = Deadlines.of_steady_schedule(NAMES, slots, 2, 3)  # warm-up 2, one local step: layers.0 and embedding
    # are as averaged before local training began
    assert early.last == {"output": 2, "layers.1": 2, "layers.0": 1, "embedding": 1}
    restored = Deadlines(NAMES, 0)
    restored.load_state_dict(derived.state_dict())
    assert restored.last == derived.last
    assert restored.overdue(7, 3) == ["layers.0"] and restored.with_overdue(["output"], 7, 3) == ["output", "layers.0"]
    assert restored.overdue(8, 3) == ["layers.0", "embedding"]
