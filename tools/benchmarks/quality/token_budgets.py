"""How many tokens an algorithm needs to reach sync's loss, measured by training it longer.

At a fixed budget every local-SGD point of the ladder ends above sync (docs/quality.md), so
its training curve never reaches sync's final loss and the planner could only give a lower
bound for its time (tools/planning/evidence.py). A *budget point* trains the same point on
`scale` times the tokens, with the whole schedule stretched (iterations, warm-up, cosine
decay: the recipe a user would run for that many tokens), from the same seed, on data still
read once, evaluated once at its own end. Where the final validation losses at scale 1 (the
point itself) and its longer budgets (1.25, 1.5, 2) bracket sync's, the multiplier is
interpolated between the two that bracket it, linearly in log tokens; where none reaches it,
the largest scale run is a lower bound. Nothing beyond the largest scale run is extrapolated; a seed counts with the scales it
has run (a scale added later lowers no bound until it has run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from tools.benchmarks.recipes import Point

BUDGET_SCALES = (1.25, 1.5, 2.0)
# The points trained longer: the defaults a user is pointed to (diloco with plain averaging at
# H = 30, streaming-diloco at H = 30), and diloco at H = 100, the interval the planner and the
# board recommend on a 1 Gbit/s link for a 1B model (where H = 30 cannot hide the exchange);
# dilocox (+7-15% at one budget) is left out for now.
BUDGET_BASES = ("diloco-H30-avg", "streaming-diloco-H30", "diloco-H100-avg")
FAMILY = "budget"


def budget_label(base: str, scale: float) -> str:
    return f"{base}-x{scale:g}"


def budget_points(points: Sequence[Point], train_iters: int, scales: Sequence[float] = BUDGET_SCALES,
                  bases: Sequence[str] = BUDGET_BASES) -> List[Point]:
    """Each base point at each scale of the tokens: --train-iters, its warm-up (a twentieth, as
    lsgd_quality.base_argv sets it) and the evaluation interval (the ladder evaluates once, at
    the end: left at the rung's iterations, a longer run would be judged mid-schedule) scaled;
    the cosine decay follows --train-iters. The flags come after the run's own, so they are the
    ones argparse keeps."""
    out = []
    for pt in points:
        if pt.label not in bases:
            continue
        for scale in scales:
            iters = round(train_iters * scale)
            out.append(Point(budget_label(pt.label, scale), FAMILY,
                             pt.flags + ["--train-iters", str(iters), "--lr-warmup-iters", str(iters // 20),
                                         "--eval-interval", str(iters)]))
    return out


def budgets_of(points: Sequence[Point], bases: Sequence[str] = BUDGET_BASES) -> Dict[str, Dict]:
    """label -> {"base": the point trained longer, "scale": its tokens / the point's}, for a
    page's JSON (what the planner reads to tell a budget point from an ordinary one)."""
    out = {}
    for pt in points:
        for base in bases:
            prefix = base + "-x"
            if pt.family == FAMILY and pt.label.startswith(prefix):
                out[pt.label] = {"base": base, "scale": float(pt.label[len(prefix):])}
    return out


@dataclass
class Reach:
    """Tokens to sync's final validation loss, over sync's tokens, for one seed: `multiplier`
    where a measured scale reaches it (interpolated), else `at_least` (the largest scale run)."""
    multiplier: Optional[float]
    at_least: Optional[float] = None


def tokens_to_reach(gaps: Dict[float, float]) -> Reach:
    """`gaps`: scale of the tokens (1.0: the point itself) -> its final validation loss over
    sync's, minus 1. The first scale whose gap is <= 0, interpolated with the one below it
    (linearly in log scale); 1.0 itself when the point already reaches it."""
    if 1.0 not in gaps:
        raise ValueError("the point's own run (scale 1) is needed")
    ordered: List[Tuple[float, float]] = sorted(gaps.items())
    prev: Optional[Tuple[float, float]] = None
    for scale, gap in ordered:
        if gap <= 0:
            if prev is None:
                return Reach(scale)
            (s0, g0), (s1, g1) = prev, (scale, gap)
            t = g0 / (g0 - g1)
            return Reach(math.exp(math.log(s0) + t * (math.log(s1) - math.log(s0))))
        prev = (scale, gap)
    return Reach(None, at_least=ordered[-1][0])


def reach_per_seed(runs_by_scale: Dict[float, Dict[str, Dict]], sync: Dict[str, Dict]) -> Dict[str, Reach]:
    """Per seed that ran the point itself (scale 1) and at least one longer budget, against
    sync's run of that seed: tokens_to_reach over the scales that seed has run, from the
    final validation losses (runs: {"valid": [...]}). A seed that has not reached sync's loss
    counts only once it has run the largest scale any seed ran: before, its bound is only the
    budgets so far, and it would turn the other seeds' measured multiplier into that bound
    (rung S: seed 2 at 1.25x alone made diloco's 1.27x a "> 1.25")."""
    out = {}
    largest = max((k for k, runs in runs_by_scale.items() if runs), default=1.0)
    for seed in sorted(sync):
        have = {k: runs[seed] for k, runs in runs_by_scale.items() if seed in runs}
        if 1.0 not in have or len(have) < 2 or not sync[seed].get("valid"):
            continue
        reach = tokens_to_reach({k: run["valid"][-1] / sync[seed]["valid"][-1] - 1.0 for k, run in have.items()})
        if reach.multiplier is not None or max(have) == largest:
            out[seed] = reach
    return out
