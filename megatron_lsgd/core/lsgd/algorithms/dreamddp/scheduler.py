"""DreamDDP's scheduler: in which iterations of a period each sync unit is averaged.

Pure Python (no torch, no processes), so it can be tested against brute force.

The time model, for one pipeline stage and one iteration of the period (DESIGN.md §4.5,
the paper's §3.3):

- units are taken in backward order, l = 0 .. L-1 (the output head first, the embedding
  last); unit l's backward takes b_l and completes at B_l = b_0 + ... + b_l;
- averaging unit l may start once B_l is reached (its parameters are not used again
  before the next forward); the link is FIFO, so the units a slot averages go one after
  the other in backward order, unit l occupying it for c_l;
- every average must have landed by the deadline D = B_{L-1} + tail, where the inner
  optimizer step waits for it (`tail` is the time from the last unit's backward to that
  wait: the intra-site reduce; the paper's model has tail = 0);
- a slot's exposed time is what its communication runs past the deadline:
  exposed(S) = max(0, end(S) - D), end(S) the FIFO completion of the units in S;
- a schedule gives each of the H slots (iterations of the period) a set of units, every
  unit in at least one; its cost is the sum of the slots' exposed times.

`dfs_schedule` searches contiguous assignments: the units in backward order are cut into
H consecutive blocks, block h averaged in iteration h. It decides unit by unit whether l
joins the open slot h or the slot is closed and l opens slot h + 1, pruned by the
paper's three rules:

1. optimal hiding: if the open slot still hides with l added (end(S_h + l) <= D), add it;
2. delayed communication-overflow assignment: if the open slot already overflows
   (end(S_h) > D), adding l would expose all of c_l: close the slot, l goes to h + 1;
3. at least one: an empty slot takes l (and, while there are no more units left than
   slots after h, the slot is closed so that every later slot gets one).

Only when S_h hides but S_h + l does not are both branches searched. Each rule keeps an
optimal completion (see docs/algorithms/dreamddp.md: adding a unit to a hidden slot only
removes work from later slots; an overflowing slot charges exactly c_l for l; splitting a
block never increases the total), so the search returns the optimum over contiguous
assignments; sub-problems "units l.. into slots h.." are memoised, so its cost is
polynomial in L and H. `brute_force_schedule` enumerates every contiguous assignment
(empty slots allowed) for the tests and the scheduler benchmark.

`fill_bubbles` then adds, slot by slot, more units (in backward order: the output side
first, whose layers the paper finds benefit most) as long as the slot's exposed time does
not grow: extra averaging that costs no time.

Everything is deterministic (plain float arithmetic in a fixed order), so every rank that
computes a schedule from the same agreed profile gets the same schedule.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

Slots = List[List[int]]  # per slot: unit indices in backward order


@dataclass(frozen=True)
class Problem:
    """One stage's scheduling problem; every list is in backward order."""

    backward: Tuple[float, ...]  # b_l, seconds
    comm: Tuple[float, ...]  # c_l, seconds
    tail: float = 0.0  # seconds from the last unit's backward to the wait before the optimizer step
    names: Tuple[str, ...] = ()

    def __post_init__(self):
        if len(self.backward) != len(self.comm):
            raise ValueError("backward and comm times must have one entry per unit")
        if any(x < 0 or not math.isfinite(x) for x in (*self.backward, *self.comm, self.tail)):
            raise ValueError("times must be finite and >= 0")
        if self.names and len(self.names) != len(self.backward):
            raise ValueError("one name per unit")

    @property
    def num_units(self) -> int:
        return len(self.backward)

    @property
    def completions(self) -> List[float]:
        return list(itertools.accumulate(self.backward))

    @property
    def deadline(self) -> float:
        return (sum(self.backward) if self.backward else 0.0) + self.tail

    def name(self, l: int) -> str:
        return self.names[l] if self.names else str(l)


def slot_end(problem: Problem, units: Sequence[int], completions: Optional[Sequence[float]] = None) -> float:
    """FIFO completion time of averaging `units` (any order given; sent in backward order);
    -inf for an empty slot."""
    B = completions if completions is not None else problem.completions
    end = -math.inf
    for l in sorted(units):
        end = max(end, B[l]) + problem.comm[l]
    return end


def slot_exposed(problem: Problem, units: Sequence[int], completions: Optional[Sequence[float]] = None) -> float:
    return max(0.0, slot_end(problem, units, completions) - problem.deadline) if units else 0.0


def total_exposed(problem: Problem, slots: Slots) -> float:
    B = problem.completions
    return sum(slot_exposed(problem, s, B) for s in slots)


@dataclass
class Search:
    slots: Slots
    exposed: float
    nodes: int  # search-tree nodes visited (one per decision about one unit)
    stats: Dict[str, int] = field(default_factory=dict)


def _check(problem: Problem, num_slots: int) -> None:
    if num_slots < 1:
        raise ValueError(f"a period needs at least one iteration (H = {num_slots})")


def _blocks(cuts: Sequence[int], num_units: int, num_slots: int) -> Slots:
    """cuts[h] = first unit of slot h (non-decreasing, cuts[0] = 0)."""
    bounds = list(cuts) + [num_units]
    return [list(range(bounds[h], bounds[h + 1])) for h in range(num_slots)]


def dfs_schedule(problem: Problem, num_slots: int) -> Search:
    """Depth-first search over contiguous assignments with the three pruning rules (see the
    module docstring); the minimum over contiguous assignments."""
    _check(problem, num_slots)
    L, H = problem.num_units, num_slots
    B, c, D = problem.completions, problem.comm, problem.deadline
    nodes = 0
    rules = {"optimal_hiding": 0, "delayed_overflow": 0, "at_least_one": 0, "branch": 0, "memo": 0}
    memo: Dict[Tuple[int, int], Tuple[float, List[int]]] = {}

    def exposed(end: float) -> float:
        return max(0.0, end - D)

    def solve(first: int, h: int) -> Tuple[float, List[int]]:
        """Best (cost, starts of slots h+1..) for units first.. with slot h opening at `first`."""
        key = (first, h)
        if key in memo:
            rules["memo"] += 1
            return memo[key]
        result = grow(first, h, first, -math.inf)
        memo[key] = result
        return result

    def grow(first: int, h: int, l: int, end: float) -> Tuple[float, List[int]]:
        # slot h holds units first..l-1 (FIFO end `end`); decide unit l
        nonlocal nodes
        nodes += 1
        if l == L:
            return exposed(end) if l > first else 0.0, []
        new_end = max(end, B[l]) + c[l]
        if h == H - 1:  # the last slot takes every unit left
            return grow(first, h, l + 1, new_end)
        if l == first:  # at least one: an empty slot takes l
            rules["at_least_one"] += 1
            return grow(first, h, l + 1, new_end)
        if L - l <= H - 1 - h:  # no more units than later slots: each later slot gets one
            rules["at_least_one"] += 1
            return close(h, l, end)
        if new_end <= D:  # optimal hiding
            rules["optimal_hiding"] += 1
            return grow(first, h, l + 1, new_end)
        if end > D:  # delayed communication-overflow assignment
            rules["delayed_overflow"] += 1
            return close(h, l, end)
        rules["branch"] += 1  # S_h hides, S_h + l overflows: both ways
        keep = grow(first, h, l + 1, new_end)
        delay = close(h, l, end)
        return keep if keep[0] <= delay[0] else delay

    def close(h: int, l: int, end: float) -> Tuple[float, List[int]]:
        rest, starts = solve(l, h + 1)
        return exposed(end) + rest, [l] + starts

    if L == 0:
        return Search([[] for _ in range(H)], 0.0, 0, rules)
    cost, starts = solve(0, 0)
    cuts = [0] + starts
    cuts += [L] * (H - len(cuts))
    slots = _blocks(cuts, L, H)
    return Search(slots, total_exposed(problem, slots), nodes, rules)


def brute_force_schedule(problem: Problem, num_slots: int) -> Search:
    """Every contiguous assignment (H consecutive, possibly empty blocks): the reference the
    DFS is tested against. Nodes: one per decision in the unpruned tree (unit l goes to the
    open slot or to any later one)."""
    _check(problem, num_slots)
    L, H = problem.num_units, num_slots
    B, c, D = problem.completions, problem.comm, problem.deadline
    best = [math.inf, None]
    nodes = 0

    def rec(l: int, h: int, cost: float, end: float, cuts: List[int]) -> None:
        nonlocal nodes
        nodes += 1
        if l == L:
            total = cost + (max(0.0, end - D) if end > -math.inf else 0.0)
            if total < best[0]:
                best[0], best[1] = total, list(cuts)
            return
        for g in range(h, H):  # unit l into slot g (g > h closes h and leaves h+1..g-1 empty)
            if g == h:
                rec(l + 1, h, cost, max(end, B[l]) + c[l], cuts)
            else:
                closed = cost + (max(0.0, end - D) if end > -math.inf else 0.0)
                rec(l + 1, g, closed, B[l] + c[l], cuts + [l] * (g - h))

    if L == 0:
        return Search([[] for _ in range(H)], 0.0, 0)
    rec(0, 0, 0.0, -math.inf, [0])
    cuts = best[1] + [L] * (H - len(best[1]))
    slots = _blocks(cuts, L, H)
    return Search(slots, total_exposed(problem, slots), nodes)


def unrestricted_optimum(problem: Problem, num_slots: int) -> Search:
    """Every assignment of each unit to exactly one slot (H^L, contiguous or not): for the
    scheduler benchmark's "how much does contiguity cost" column only (small L)."""
    _check(problem, num_slots)
    L, H = problem.num_units, num_slots
    B = problem.completions
    best_cost, best = math.inf, None
    count = 0
    for assign in itertools.product(range(H), repeat=L):
        if assign and assign[0] != 0:  # slots are interchangeable: fix the first unit's slot
            continue
        count += 1
        slots: Slots = [[] for _ in range(H)]
        for l, g in enumerate(assign):
            slots[g].append(l)
        cost = sum(slot_exposed(problem, s, B) for s in slots)
        if cost < best_cost:
            best_cost, best = cost, slots
    return Search(best or [[] for _ in range(H)], best_cost if best is not None else 0.0, count)


def equal_number_schedule(problem: Problem, num_slots: int) -> Search:
    """The paper's PLSGD-ENP baseline: consecutive blocks whose sizes differ by at most one
    (the earlier blocks, on the output side, take the extra units)."""
    _check(problem, num_slots)
    L, H = problem.num_units, num_slots
    base, extra = divmod(L, H)
    cuts, start = [], 0
    for h in range(H):
        cuts.append(start)
        start += base + (1 if h < extra else 0)
    slots = _blocks(cuts, L, H)
    return Search(slots, total_exposed(problem, slots), 0)


def fill_bubbles(problem: Problem, slots: Slots) -> Slots:
    """Add units to slots while the slot's exposed time does not grow (candidates in
    backward order); returns new slots, each sorted in backward order."""
    B = problem.completions
    out: Slots = []
    for s in slots:
        current = sorted(s)
        cost = slot_exposed(problem, current, B)
        for u in range(problem.num_units):
            if u in current:
                continue
            trial = sorted(current + [u])
            if slot_exposed(problem, trial, B) <= cost:
                current = trial
        out.append(current)
    return out


SCHEDULERS = {"dfs": dfs_schedule, "equal": equal_number_schedule}


def schedule(problem: Problem, num_slots: int, method: str = "dfs", bubble_fill: bool = True) -> Tuple[Slots, Search]:
    """The schedule the algorithm runs: the search's slots, then bubble filling."""
    if method not in SCHEDULERS:
        raise ValueError(f"scheduler {method!r}: choose one of {', '.join(SCHEDULERS)}")
    search = SCHEDULERS[method](problem, num_slots)
    slots = fill_bubbles(problem, search.slots) if bubble_fill else [list(s) for s in search.slots]
    return slots, search
