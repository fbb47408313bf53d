"""The schedule of every pipeline stage, computed from the agreed profile (identical on
every rank), and its printout.

Tied word embeddings with PP > 1: the first stage's `embedding` and the last stage's
`output` hold copies of one matrix that receive the same gradient every step; averaged
in different iterations they would drift apart for good. Both are therefore averaged in
the union of the slots the two stages' schedules give them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Dict, List, Tuple

from megatron_lsgd.core.lsgd.algorithms.dreamddp.profile import Profile, read_profile_file
from megatron_lsgd.core.lsgd.algorithms.dreamddp.scheduler import schedule, slot_exposed


@dataclass
class StagePlan:
    names: List[str]  # backward order
    slots: List[List[str]]  # per slot, backward order: what is averaged
    searched: List[List[str]]  # the search's slots (before bubble filling and the tied union)
    filled: List[List[str]]  # after bubble filling (before the tied union)
    exposed_s: List[float]  # predicted per slot
    nodes: int  # search-tree nodes visited


@dataclass
class Plan:
    interval: int
    method: str
    bubble_fill: bool
    stages: List[StagePlan]

    def slot_units(self, stage: int, slot: int) -> List[str]:
        return self.stages[stage].slots[slot]

    def to_dict(self) -> Dict:
        return {"interval": self.interval, "method": self.method, "bubble_fill": self.bubble_fill,
                "stages": [{"names": s.names, "slots": s.slots, "searched": s.searched, "filled": s.filled,
                            "predicted_exposed_ms": [1e3 * x for x in s.exposed_s], "nodes": s.nodes}
                           for s in self.stages]}


def build_plan(profile: Profile, interval: int, method: str, bubble_fill: bool) -> Plan:
    stages = []
    for stage in range(profile.num_stages):
        problem = profile.problem(stage)
        slots, search = schedule(problem, interval, method, bubble_fill)
        names = list(problem.names)
        filled = [[names[i] for i in s] for s in slots]
        stages.append(StagePlan(names, [list(s) for s in filled], [[names[i] for i in s] for s in search.slots],
                                filled, [], search.nodes))
    if profile.tied_embeddings and profile.num_stages > 1:
        first, last = stages[0], stages[-1]
        for h in range(interval):
            if "embedding" in first.slots[h] or "output" in last.slots[h]:
                for st, name in ((first, "embedding"), (last, "output")):
                    if name not in st.slots[h]:
                        st.slots[h] = [n for n in st.names if n in st.slots[h] or n == name]
    for stage, st in enumerate(stages):
        problem = profile.problem(stage)
        index = {n: i for i, n in enumerate(st.names)}
        st.exposed_s = [slot_exposed(problem, [index[n] for n in s]) for s in st.slots]
    return Plan(interval, method, bubble_fill, stages)


def format_plan(plan: Plan, profile: Profile, header: str) -> str:
    """The schedule as printed in the log (see docs/algorithms/dreamddp.md for how to read it)."""
    H = plan.interval
    link = f"{1e3 * profile.latency_s:.2f} ms + {1e3 * profile.seconds_per_byte * 2**20:.2f} ms/MB"
    lines = [f"> dreamddp schedule: {header}",
             f"  H = {H}, scheduler {plan.method}{' + bubble filling' if plan.bubble_fill else ''}; "
             f"profile: {profile.source}; averaging time c = collectives x latency + MB x slope, link fit {link}"]
    by_name = {u.name: u for u in profile.units}
    for stage, st in enumerate(plan.stages):
        problem = profile.problem(stage)
        lines.append(f"  stage {stage}: backward {1e3 * sum(problem.backward):.2f} ms + tail "
                     f"{1e3 * problem.tail:.2f} ms = deadline {1e3 * problem.deadline:.2f} ms after the first "
                     f"unit's backward starts")
        width = max(len(n) for n in st.names) if st.names else 4
        lines.append(f"    {'unit':<{width}}  {'b ms':>8}  {'MB':>8}  {'c ms':>8}  slots 1..{H} "
                     f"(# searched, + bubble filling, = with its tied copy, . not averaged)")
        for name in st.names:
            u = by_name[name]
            marks = "".join("#" if name in st.searched[h] else "+" if name in st.filled[h]
                            else "=" if name in st.slots[h] else "." for h in range(H))
            lines.append(f"    {name:<{width}}  {1e3 * u.backward_s:8.2f}  {u.bytes / 2**20:8.3f}  "
                         f"{1e3 * profile.comm_s(u):8.2f}  {marks}")
        for h in range(H):
            if not st.slots[h]:
                continue
            lines.append(f"    slot {h + 1}: {', '.join(st.slots[h])}  -> predicted exposed "
                         f"{1e3 * st.exposed_s[h]:.2f} ms")
        empty = sum(1 for s in st.slots if not s)
        total = sum(st.exposed_s)
        per_period = sum(len(s) for s in st.slots)
        lines.append(f"    per period: predicted exposed {1e3 * total:.2f} ms ({1e3 * total / H:.2f} ms/step), "
                     f"{per_period} unit averages for {len(st.names)} units"
                     + (f", {empty} slot(s) with nothing to average" if empty else "")
                     + (f"; the search visited {st.nodes} nodes (there are {contiguous_count(len(st.names), H)} "
                        f"contiguous assignments)" if plan.method == "dfs" else ""))
    return "\n".join(lines)


def contiguous_count(num_units: int, interval: int) -> int:
    """Contiguous assignments of L units to H slots (possibly empty blocks): C(L+H-1, H-1)."""
    return math.comb(num_units + interval - 1, interval - 1)


SCHEDULE_FLAG = "--lsgd-dreamddp-schedule"


def read_schedule_file(path: str) -> Tuple[Dict, Plan, int]:
    """A profiling run's dreamddp_profile.json as a pinned schedule: (its profile as
    read_profile_file gives it, the plan it ran, the iteration its first period began).
    ValueError naming the flag, the file and the field."""
    profile = read_profile_file(path, SCHEDULE_FLAG)
    with open(path) as f:
        doc = json.load(f)
    where = f"{SCHEDULE_FLAG} {path}"
    if not isinstance(doc, dict) or "schedule" not in doc or "origin_iteration" not in doc:
        raise ValueError(f"{where}: holds a profile but no schedule (field 'schedule' / 'origin_iteration'): give "
                         f"the dreamddp_profile.json a profiling run wrote, or pass it as --lsgd-dreamddp-profile")
    if doc.get("reprofiles", 0):
        raise ValueError(f"{where}: written after {doc['reprofiles']} re-profiles (field 'reprofiles'): it holds only "
                         f"the last schedule, not the ones the run used before it, so it cannot reproduce that run")
    try:
        q = doc["schedule"]
        stages = [StagePlan([str(n) for n in s["names"]], [[str(n) for n in slot] for slot in s["slots"]],
                            s["searched"], s["filled"], [float(x) / 1e3 for x in s["predicted_exposed_ms"]],
                            int(s["nodes"])) for s in q["stages"]]
        plan = Plan(int(q["interval"]), str(q["method"]), bool(q["bubble_fill"]), stages)
        origin = int(doc["origin_iteration"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{where}: field 'schedule' is damaged ({type(err).__name__}: {err})") from None
    if origin < 0 or plan.interval < 1 or any(len(st.slots) != plan.interval for st in stages):
        raise ValueError(f"{where}: field 'schedule' is damaged (interval {plan.interval}, origin {origin}, slots "
                         f"per stage {[len(st.slots) for st in stages]})")
    return profile, plan, origin

