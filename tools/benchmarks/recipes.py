"""Every algorithm's settings in the benchmarks: one recipe per algorithm, read by every tool,
so that adding an algorithm to the benchmarks is one entry of RECIPES (a tool asked for an
algorithm without one stops with an error naming this file).

A recipe's flags are what follows `--lsgd-algorithm NAME` (the tools put that first):
- `default(k)`: lsgd_quality.py's run of the algorithm, labelled by its name, at that tool's
  knobs `k` (its arguments: k.interval, k.outer_lr, ...); `variants(k)`: its other named runs;
- `recommended(scenario, h)`: a leaderboard cell's settings on a scenario, at the outer interval
  H recommended for it (recommended_interval) or at another (tools/plan.py's pilots and their
  grid); `board_variants`: tuned rows of the board per scenario name, flags after the
  recommended ones, where a target's miss asks what a user who knows the scenario would set;
  `free_link`: where a site is slow, also a row on the scenario with a free link: what the
  link costs it in progress (its ceiling);
- `frontier(interval, num_layers)`, `ladder(outer_lrs)`, `claims()`: quality_frontier.py's points.

A leaderboard cell and a quality_frontier run are cached under a digest of their flags
(run_cache.py): a recipe whose flags change, even in order, trains its runs again and leaves
the committed ones unread. tests/unit_tests/tools/test_recipes.py freezes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from megatron_lsgd.training.scenario import Scenario


@dataclass
class Point:
    """A point of a quality sweep (quality_frontier.py): a labelled run of one algorithm."""
    label: str
    family: str  # the algorithm x compressor whose knobs the point sweeps
    flags: List[str]


# ---- the leaderboard's model, as far as its recommended settings depend on it ---------------------
LAYERS = 2  # the board model's layers, also the streaming family's fragments (one layer each)
TRAINED_PARAMS_GUESS = 1_491_584  # the board model with the 8k vocabulary (each run prints its count)
# acco/dpu accumulate while the exchange is in flight; at most this many micro-batches per
# stage (16 x the minimum by default) keeps a cell's real compute within a few minutes.
MAX_MICROBATCHES = 4


def recommended_interval(scenario: Scenario) -> int:
    """H such that one full-model exchange costs at most a tenth of H steps' compute, rounded
    up to a multiple of the streaming family's fragments (a round is cut into equal slots)."""
    step = scenario.microbatch_seconds * max(scenario.site_factors) + scenario.optimizer_step_seconds
    scale = scenario.bytes_scale_for(TRAINED_PARAMS_GUESS)
    nbytes = 4 * TRAINED_PARAMS_GUESS * scale * 2 * (scenario.sites - 1) / scenario.sites
    rate = min(scenario.rate_mbit) * 1e6
    exchange = (nbytes * 8 / rate if rate > 0 else 0.0) + max(scenario.latency_ms) / 1e3
    h = int(min(100, max(5, math.ceil(10 * exchange / step))))
    return -(-h // LAYERS) * LAYERS


# ---- flags several recipes share ---------------------------------------------------------------------
def _outer(k) -> List[str]:
    """lsgd_quality.py's outer loop: H, outer lr and momentum."""
    return ["--lsgd-interval", str(k.interval), "--lsgd-outer-lr", str(k.outer_lr),
            "--lsgd-outer-momentum", str(k.outer_momentum)]


def _outer_x(k) -> List[str]:
    """dilocox's in lsgd_quality.py: its own outer momentum, restart and apply step."""
    return ["--lsgd-interval", str(k.interval), "--lsgd-outer-lr", str(k.outer_lr),
            "--lsgd-outer-momentum", str(k.dilocox_outer_momentum), "--lsgd-dilocox-restart", k.restart,
            "--lsgd-dilocox-apply-step", str(k.apply_step)]


def _penalty(k) -> List[str]:
    """edit's penalty warm-up in lsgd_quality.py (a short run has few syncs)."""
    return ["--lsgd-edit-ema-warmup", str(k.edit_ema_warmup)]


def _fragments(k) -> List[str]:
    return ["--lsgd-fragments", str(k.fragments), "--lsgd-fragment-partition", k.fragment_partition,
            "--lsgd-fragment-sync-delay", str(k.sync_delay)]


def _board_outer(s: Scenario, h: int) -> List[str]:
    """The board's outer loop: H, plain averaging (outer lr 1, momentum 0); diloco's and edit's
    recommended settings as they are."""
    return ["--lsgd-interval", str(h), "--lsgd-outer-lr", "1.0", "--lsgd-outer-momentum", "0.0"]


def _board_fragments(h: int) -> List[str]:
    """One fragment per layer, tau = min(5, H / 8)."""
    return ["--lsgd-fragments", str(LAYERS), "--lsgd-fragment-sync-delay", str(min(5, max(1, h // 8)))]


def _frontier_fragments(interval: int, num_layers: int) -> Tuple[int, List[str]]:
    """(K, flags): a fragment needs a layer, and K slots of H/K steps make a round: the most
    fragments up to 4 that do; tau < H / K."""
    k = next(k for k in range(min(4, num_layers), 0, -1) if interval % k == 0)
    tau = max(0, min(5, interval // k - 1))
    return k, ["--lsgd-interval", str(interval), "--lsgd-fragments", str(k), "--lsgd-fragment-sync-delay", str(tau)]


PLAIN = ["--lsgd-outer-lr", "1.0", "--lsgd-outer-momentum", "0"]  # the frontier's plain averaging
CLAIMS_FRAGMENTS = ["--lsgd-interval", "30", "--lsgd-fragments", "2", "--lsgd-fragment-sync-delay", "5"]
# Equal tokens: the configured micro-batches every step (adaptive accumulation would add some
# whenever the overlapped reduce + step outlast a stage's compute).
FIXED = ["--lsgd-accumulation", "fixed"]


def _none(*_) -> list:
    return []


@dataclass(frozen=True)
class Recipe:
    """One algorithm's settings in every benchmark (see the module's docstring)."""
    default: Callable[[Any], List[str]]
    recommended: Callable[[Scenario, int], List[str]]
    variants: Callable[[Any], Dict[str, List[str]]] = lambda k: {}
    frontier: Callable[[int, int], List[Point]] = _none
    ladder: Callable[[Sequence[float]], List[Point]] = _none
    claims: Callable[[], List[Point]] = _none
    ladder_frontier: Callable[[], List[Point]] = _none
    board_variants: Dict[str, Tuple[Tuple[str, Tuple[str, ...]], ...]] = field(default_factory=dict)
    free_link: bool = False


def _diloco_frontier(interval: int, num_layers: int) -> List[Point]:
    h = ["--lsgd-interval", str(interval)]
    pts = [Point(f"diloco-lr{lr}-m{mom}", "diloco", h + ["--lsgd-outer-lr", str(lr), "--lsgd-outer-momentum", str(mom)])
           for lr, mom in ((0.7, 0.9), (1.0, 0.0), (0.7, 0.5))]
    pts.append(Point("diloco-momwarm", "diloco", h + ["--lsgd-outer-lr", "0.7", "--lsgd-outer-momentum", "0.9",
                                                      "--lsgd-outer-momentum-warmup", "5"]))
    pts += [Point(f"diloco-H{h2}", "diloco", ["--lsgd-interval", str(h2)] + PLAIN)
            for h2 in (2 * interval, 4 * interval)]
    pts += [Point(f"sparseloco-d{density:.4f}", "diloco x topk-2bit",
                  h + PLAIN + ["--lsgd-compression", "topk-2bit", "--lsgd-topk-density", str(density),
                               "--lsgd-ef-decay", "0.95"]) for density in (1 / 64, 1 / 32)]
    pts.append(Point("muloco-int4", "diloco x int4 (muon)", h + PLAIN + ["--lsgd-compression", "int4",
                                                                         "--optimizer", "muon"]))
    pts.append(Point("diloco-int4", "diloco x int4", h + PLAIN + ["--lsgd-compression", "int4"]))
    return pts


def _diloco_ladder_frontier() -> List[Point]:
    """Issue 24's compressors on the ladder (family "frontier", run on request), each on the
    ladder's default, diloco with plain averaging at H = 30, so that the gap against
    diloco-H30-avg is the compressor's: int4 (and at H = 100, toward 1000x fewer bytes),
    topk-2bit at 1/64 (SparseLoCo), low-rank int4 at rank 8 (every rung's matrices are at least
    48 wide), and MuLoCo (int4 with Muon inside the sites, against sync with Muon)."""
    def point(label, flags, interval=30):
        return Point(label, "frontier", ["--lsgd-interval", str(interval)] + PLAIN + flags)

    return [point("diloco-H30-int4", ["--lsgd-compression", "int4"]),
            point("diloco-H100-int4", ["--lsgd-compression", "int4"], 100),
            point("sparseloco-H30-d0.0156", ["--lsgd-compression", "topk-2bit", "--lsgd-topk-density", str(1 / 64),
                                             "--lsgd-ef-decay", "0.95"]),
            point("diloco-H30-lowrank8", ["--lsgd-compression", "lowrank-int4", "--lsgd-rank", "8"]),
            point("muloco-H30-int4", ["--lsgd-compression", "int4", "--optimizer", "muon"])]


def _diloco_ladder(outer_lrs: Sequence[float]) -> List[Point]:
    """At H = 30 and 100: plain averaging and Nesterov 0.9 at each outer lr."""
    pts = []
    for h in (30, 100):
        pts.append(Point(f"diloco-H{h}-avg", f"diloco H={h}", ["--lsgd-interval", str(h)] + PLAIN))
        pts += [Point(f"diloco-H{h}-nesterov-lr{lr}", f"diloco H={h}",
                      ["--lsgd-interval", str(h), "--lsgd-outer-lr", str(lr), "--lsgd-outer-momentum", "0.9"])
                for lr in outer_lrs]
    return pts


def _cocodc_frontier(interval: int, num_layers: int) -> List[Point]:
    # N fixed at K: the adaptive N measures this run's exchange (fast and local here, so it syncs a
    # fragment almost every step); at N = K cocodc sends what streaming-diloco sends
    k, frag = _frontier_fragments(interval, num_layers)
    return [Point(f"cocodc-l{lam}-{norm}", "cocodc", ["--lsgd-cocodc-lambda", str(lam), "--lsgd-cocodc-dc-normalize",
                                                      norm, "--lsgd-cocodc-syncs-per-round", str(k)] + frag)
            for lam, norm in ((0.0, "none"), (0.5, "none"), (0.5, "mean-square"), (2.0, "mean-square"))]


def _cocodc_claims() -> List[Point]:
    """cocodc's delay compensation (a lambda sweep, N fixed at K so it sends what streaming-diloco
    sends) against streaming-diloco at the same K and tau."""
    return [Point(f"claims-cocodc-l{lam}-{norm}", "claims",
                  ["--lsgd-cocodc-lambda", str(lam), "--lsgd-cocodc-dc-normalize", norm,
                   "--lsgd-cocodc-syncs-per-round", "2"] + CLAIMS_FRAGMENTS)
            for lam, norm in ((0.0, "none"), (0.5, "mean-square"), (2.0, "mean-square"))]


def _a_edit_frontier(interval: int, num_layers: int) -> List[Point]:
    # a-edit's interval is seconds (default 600, longer than a whole sweep run here: the sites met
    # once, at the end); on a simulated clock at 1 s per step, tau = H seconds is H steps
    return [Point(f"a-edit-tau{interval}", "a-edit", ["--simulate-clock", "--simulate-microbatch-seconds", "0",
                                                      "--simulate-optimizer-step-seconds", "1",
                                                      "--lsgd-aedit-interval-seconds", str(interval)])]


def _a_edit_recommended(s: Scenario, h: int) -> List[str]:
    """An interval of H steps' time."""
    step = s.microbatch_seconds + s.optimizer_step_seconds
    return ["--lsgd-aedit-interval-seconds", f"{h * step:.4g}", "--lsgd-outer-lr", "1.0",
            "--lsgd-outer-momentum", "0.0"]


# Board variants' labels (leaderboard_report.py judges targets by them).
ACCO_FIXED = "acco (fixed 8,2)"
DPU_WARMUP = "dpu (warm-up 100)"

# In the leaderboard's order (its rows, its default --algorithms).
RECIPES: Dict[str, Recipe] = {
    "sync": Recipe(default=_none, recommended=_none),
    "diloco": Recipe(default=_outer, recommended=_board_outer, frontier=_diloco_frontier, ladder=_diloco_ladder,
                     ladder_frontier=_diloco_ladder_frontier),
    "dilocox": Recipe(
        default=_outer_x,
        variants=lambda k: {"dilocox-none": _outer_x(k),  # the default's older name
                            "dilocox-int4": ["--lsgd-compression", "int4"] + _outer_x(k),
                            "dilocox-lowrank-int4": ["--lsgd-compression", "lowrank-int4", "--lsgd-rank",
                                                     str(k.rank)] + _outer_x(k)},
        recommended=lambda s, h: _board_outer(s, h) + ["--lsgd-compression", "int4"],
        frontier=lambda interval, num_layers: [
            Point(f"dilocox-lowrank{rank}", "dilocox x lowrank-int4",
                  ["--lsgd-interval", str(interval)] + PLAIN + ["--lsgd-compression", "lowrank-int4", "--lsgd-rank",
                                                                str(rank)]) for rank in (4, 16)],
        ladder=lambda outer_lrs: [Point("dilocox-H30", "dilocox", ["--lsgd-interval", "30"])],
        # its recommended setting (the planner's dilocox row), against dilocox-H30 for what int4 costs
        ladder_frontier=lambda: [Point("dilocox-H30-int4", "frontier",
                                       ["--lsgd-interval", "30", "--lsgd-compression", "int4"])]),
    "streaming-diloco": Recipe(
        default=lambda k: ["--lsgd-fragment-update-alpha", str(k.alpha)] + _outer(k) + _fragments(k),
        recommended=lambda s, h: _board_outer(s, h) + _board_fragments(h),
        frontier=lambda interval, num_layers: [
            Point(f"streaming-alpha{alpha}", "streaming-diloco", ["--lsgd-fragment-update-alpha", str(alpha)]
                  + _frontier_fragments(interval, num_layers)[1]) for alpha in (0.0, 0.5, 1.0)],
        ladder=lambda outer_lrs: [Point("streaming-diloco-H30", "streaming-diloco", ["--lsgd-interval", "30"])],
        claims=lambda: [Point("claims-streaming-K2-tau5", "claims", list(CLAIMS_FRAGMENTS))]),
    "cocodc": Recipe(
        default=lambda k: ["--lsgd-cocodc-lambda", str(k.dc_lambda), "--lsgd-cocodc-gamma", str(k.gamma),
                           "--lsgd-cocodc-syncs-per-round", str(k.syncs_per_round)] + _outer(k) + _fragments(k),
        recommended=lambda s, h: _board_outer(s, h) + _board_fragments(h),
        frontier=_cocodc_frontier, claims=_cocodc_claims),
    # dreamddp averages parameters (no outer optimizer): compare it with diloco at outer lr 1,
    # momentum 0, which averages the whole model every H steps
    "dreamddp": Recipe(
        default=lambda k: ["--lsgd-interval", str(k.interval)],
        variants=lambda k: {"dreamddp-nofill": ["--lsgd-interval", str(k.interval), "--lsgd-dreamddp-no-bubble-fill"],
                            "dreamddp-enp": ["--lsgd-interval", str(k.interval), "--lsgd-dreamddp-scheduler", "equal",
                                             "--lsgd-dreamddp-no-bubble-fill"]},
        recommended=lambda s, h: ["--lsgd-interval", str(h)]),
    # dpu's tuned row on emulated-default, where it misses sync's loss: its first 100 updates (about
    # a third of its steps there) undelayed, the warm-up that brought it within 3% of sync in the
    # quality frontier (docs/algorithms/acco.md): does the quality it buys pay for the overlap it
    # gives up?
    "dpu": Recipe(
        default=lambda k: list(FIXED), recommended=lambda s, h: ["--lsgd-max-microbatches", str(MAX_MICROBATCHES)],
        frontier=lambda interval, num_layers: [Point("dpu", "dpu", list(FIXED))],
        claims=lambda: [Point("claims-dpu-fixed", "claims", list(FIXED))],
        board_variants={"emulated-default": ((DPU_WARMUP, ("--lsgd-dpu-warmup-iters", "100")),)}),
    # acco splits a step into an estimate and a real stage of at least one micro-batch each: two
    # per site per step on the board, twice the others' minimum (adaptive accumulation adds more).
    # Its tuned row with one site 4x slower: fixed counts in proportion to the sites' speeds (4 + 4 micro-batches
    # per step on the fast site, 1 + 1 on the slow one), the counts its adaptive accumulation
    # settles on, without the exchange of counts every stage.
    "acco": Recipe(
        default=lambda k: list(FIXED),
        recommended=lambda s, h: ["--lsgd-site-microbatches", ",".join(["2"] * s.sites),
                                  "--lsgd-max-microbatches", str(MAX_MICROBATCHES)],
        board_variants={"emulated-1gbit-straggler4x": (
            (ACCO_FIXED, ("--lsgd-accumulation", "fixed", "--lsgd-site-microbatches", "8,2")),)}),
    "edit": Recipe(
        default=lambda k: _penalty(k) + _outer(k),
        variants=lambda k: {
            "edit-nopenalty": ["--lsgd-edit-penalty", "none"] + _outer(k),
            "edit-anomaly": ["--lsgd-edit-penalty", "anomaly"] + _penalty(k) + _outer(k),
            "edit-int4": ["--lsgd-compression", "int4"] + _penalty(k) + _outer(k),
            "edit-fault": ["--lsgd-edit-inject-fault", k.fault] + _penalty(k) + _outer(k),
            "edit-nopenalty-fault": ["--lsgd-edit-penalty", "none", "--lsgd-edit-inject-fault", k.fault] + _outer(k)},
        recommended=_board_outer),
    "a-edit": Recipe(
        default=lambda k: ["--lsgd-aedit-interval-seconds", str(k.aedit_seconds), "--lsgd-outer-lr", str(k.outer_lr),
                           "--lsgd-outer-momentum", str(k.outer_momentum)] + _penalty(k),
        recommended=_a_edit_recommended, frontier=_a_edit_frontier,
        free_link=True),  # its target under a slow site is measured against this ceiling
}
ALGORITHMS = tuple(RECIPES)


def recipe(algorithm: str) -> Recipe:
    """The algorithm's recipe; a clear error, not a KeyError, for one that has none."""
    if algorithm not in RECIPES:
        raise ValueError(f"{algorithm!r} has no recipe: add one to tools/benchmarks/recipes.py (RECIPES), "
                         f"which every benchmark reads")
    return RECIPES[algorithm]


def recommended(algorithm: str, scenario: Scenario, interval: Optional[int] = None) -> List[str]:
    """The leaderboard's settings for `algorithm` on `scenario` (after --lsgd-algorithm), at the
    recommended outer interval or at `interval` (a grid point of tools/plan.py)."""
    return recipe(algorithm).recommended(scenario, interval or recommended_interval(scenario))


def board_variants(scenario_name: str) -> List[Tuple[str, str, Tuple[str, ...]]]:
    """The board's tuned rows on a scenario: (label, algorithm, flags after the recommended ones)."""
    return [(label, name, flags) for name, r in RECIPES.items()
            for label, flags in r.board_variants.get(scenario_name, ())]


def quality_runs(k) -> Dict[str, List[str]]:
    """lsgd_quality.py's built-in runs at its arguments `k`: label -> flags, --lsgd-algorithm first."""
    runs = {}
    for name, r in RECIPES.items():
        for label, flags in {name: r.default(k), **r.variants(k)}.items():
            runs[label] = ["--lsgd-algorithm", name] + flags
    return runs


def points(study: str, *args) -> List[Point]:
    """Every recipe's points of a quality study ("frontier", "ladder", "claims" or
    "ladder_frontier"; `args` those of the recipe's function), in the table's order, each run's
    flags --lsgd-algorithm first."""
    return [Point(p.label, p.family, ["--lsgd-algorithm", name] + p.flags)
            for name, r in RECIPES.items() for p in getattr(r, study)(*args)]
