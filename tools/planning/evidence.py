"""The project's measured quality evidence, for the planner (tools/plan.py).

Every quality page's JSON written by tools/benchmarks/quality/quality_frontier.py (`results/quality*.json`,
the raw data of the docs/quality*.md pages, the model-size ladder's `results/quality-ladder-*.json`
included) is read through one loader. Each
file says in its argv the model it trained (layers, hidden size, sequence, batch, iterations)
and in its results the seeds; from those come the model size, the tokens per parameter and
the seeds of every figure, which label it wherever it is shown.

The figure the planner needs is a multiplier: the tokens an algorithm needs to reach sync's
final training loss, over sync's tokens (from the logged training curves, the mean over the
seeds both ran). An algorithm that does not reach sync's loss within the measured run has no
multiplier (`None`), only its final gap: nothing is extrapolated. A point whose label names a
compressor (diloco-int4, dilocox-lowrank4, sparseloco-d0.0156) is kept apart from its
algorithm's uncompressed figure (`figure_key`): it stands only for a row with that compressor.
Where the page also trained the point on more tokens (its budget points,
tools/benchmarks/quality/token_budgets.py), the multiplier is the one those runs measure
(sync's final validation loss reached between two budgets), or, where none reached it, at
least the largest budget (`at_least`).
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import statistics
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Tuple

VOCAB = 8192  # the quality runs' SentencePiece tokenizer (data/python-docs/python_docs_sp8k.model)
FAR_FACTOR = 10.0  # a target this many times beyond the measured model size or tokens/param is "far"


@dataclass
class Figure:
    point: str        # the quality page's label
    algorithm: str
    multiplier: Optional[float]  # tokens to sync's final training loss / sync's tokens (None: not reached)
    final_gap: float  # final training loss / sync's - 1 (mean over seeds)
    seeds: List[str]
    at_least: Optional[float] = None  # not reached even on this many times the tokens (budget points)
    how: str = "training curves"  # where the multiplier comes from


@dataclass
class Evidence:
    path: str
    params: float
    tokens: float
    seeds: List[str]
    figures: Dict[str, Figure]  # by figure_key (the algorithm, and its compressor if any): its best-measured point
    points: Dict[str, Figure] = field(default_factory=dict)  # every point's figure, by its label

    @property
    def tokens_per_param(self) -> float:
        return self.tokens / self.params

    def label(self) -> str:
        return (f"{os.path.basename(self.path)}: {self.params / 1e6:.2g}M params, {self.tokens / 1e6:.3g}M tokens "
                f"({self.tokens_per_param:.3g} tokens/param), seeds {','.join(self.seeds)}")


def algorithm_of(point: str) -> str:
    """The algorithm a quality page's point label names (labels begin with it; SparseLoCo is
    diloco with topk-2bit)."""
    for name in ("streaming-diloco", "streaming", "a-edit", "dilocox", "diloco", "muloco", "cocodc", "dreamddp",
                 "acco", "dpu", "edit", "sparseloco"):
        if point.startswith(name):
            return {"streaming": "streaming-diloco", "sparseloco": "diloco"}.get(name, name)
    return point.split("-")[0]


# label parts that name a compressed exchange, and the compressor (first match): such a point is
# the algorithm with that compressor, not the algorithm as an uncompressed row runs it
COMPRESSION_MARKS = (("lowrank", "lowrank-int4"), ("sparseloco", "topk-2bit"), ("topk", "topk-2bit"),
                     ("int4", "int4"), ("int8", "int8"))
OTHER_INNER = ("muloco",)  # another inner optimizer (Muon): stands for no row the planner runs


def compression_of(point: str) -> str:
    """The compressor a quality page's point label names (diloco-int4, dilocox-lowrank4,
    sparseloco-d0.0156, diloco-H200-int4), "none" where it names none."""
    return next((kind for mark, kind in COMPRESSION_MARKS if mark in point), "none")


def figure_key(algorithm: str, compression: str = "none") -> str:
    """Where Evidence.figures keeps an algorithm's figure: by its name uncompressed, else with
    its compressor ("diloco compression=int4", the planner's grid row's label)."""
    return algorithm if compression == "none" else f"{algorithm} compression={compression}"


def _flag(argv: Sequence[str], name: str, default=None):
    return argv[argv.index(name) + 1] if name in argv else default


def trained_params(argv: Sequence[str]) -> float:
    """The quality run's model from its argv (Llama-style: swiglu, no biases, untied unless
    said otherwise: this project's default ties the embeddings)."""
    from tools.planning.job import Model

    h = int(_flag(argv, "--hidden-size"))
    return Model(num_layers=int(_flag(argv, "--num-layers")), hidden_size=h,
                 num_attention_heads=int(_flag(argv, "--num-attention-heads", 1)), vocab_size=VOCAB,
                 swiglu="--swiglu" in argv,
                 untie_embeddings="--untie-embeddings-and-output-weights" in argv).parameter_count()


def _tail(losses: List[float], n: int = 5) -> float:
    """The end of a logged curve, averaged over its last few points (one point is noisy)."""
    return statistics.fmean(losses[-n:])


def _steps_to(losses: List[float], target: float, n: int = 5) -> Optional[float]:
    """The fraction of the run at which a curve's running mean first reaches `target`."""
    for i in range(n - 1, len(losses)):
        if statistics.fmean(losses[i - n + 1:i + 1]) <= target:
            return (i + 1) / len(losses)
    return None


def read_evidence(path: str) -> Evidence:
    with open(path) as f:
        data = json.load(f)
    try:
        argv, results, sync = data["argv"], data["results"], data["sync"]["sync"]
    except (KeyError, TypeError):
        raise ValueError(f"{path}: not a quality page's JSON (keys label, argv, sync, results)") from None
    # the page's own count where it states one (the ladder's, at its 4,096-piece vocabulary);
    # else from argv at the quality runs' 8,192-piece tokenizer
    params = float(data["model_parameters"]["total"]) if "model_parameters" in data else trained_params(argv)
    tokens = float(_flag(argv, "--train-iters")) * float(_flag(argv, "--global-batch-size")) * \
        float(_flag(argv, "--seq-length"))
    budgets = data.get("budgets") or {}  # label -> {"base", "scale"}: the same point on more tokens
    figures: Dict[str, Figure] = {}
    every: Dict[str, Figure] = {}
    for point, by_seed in results.items():
        if point in budgets or point.startswith(OTHER_INNER):
            continue  # a budget: read with its base point (_with_budgets); MuLoCo: no row runs Muon
        seeds = sorted(s for s in by_seed if s in sync and by_seed[s].get("train") and sync[s].get("train"))
        if not seeds:
            continue
        fractions, gaps = [], []
        for seed in seeds:
            target = _tail(sync[seed]["train"])
            fractions.append(_steps_to(by_seed[seed]["train"], target))
            gaps.append(_tail(by_seed[seed]["train"]) / target - 1)
        multiplier = statistics.fmean(fractions) if all(f is not None for f in fractions) else None
        figure = Figure(point, algorithm_of(point), multiplier, statistics.fmean(gaps), seeds)
        if multiplier is None:
            figure = _with_budgets(figure, results, sync, budgets)
        key = figure_key(figure.algorithm, compression_of(point))
        every[point] = figure
        best = figures.get(key)
        if best is None or _better(figure, best):
            figures[key] = figure
    all_seeds = sorted({s for f in figures.values() for s in f.seeds})
    return Evidence(path, params, tokens, all_seeds, figures, every)


def _with_budgets(figure: Figure, results: Dict, sync: Dict, budgets: Dict[str, Dict]) -> Figure:
    """`figure` (a point that did not reach sync's loss) with the multiplier its budget points
    measure: per seed, the tokens at which its final validation loss reaches sync's
    (token_budgets.reach_per_seed), their mean; where a seed reached it at no budget it ran,
    the largest such budget as a lower bound. Unchanged without budgets."""
    from tools.benchmarks.quality.token_budgets import reach_per_seed

    scales = {1.0: results[figure.point], **{b["scale"]: results.get(label, {})
                                             for label, b in budgets.items() if b["base"] == figure.point}}
    by_seed = reach_per_seed(scales, sync)
    if not by_seed:
        return figure
    seeds, reached = list(by_seed), list(by_seed.values())
    ran = sorted(k for k, runs in scales.items() if any(s in runs for s in seeds))
    how = f"runs at {', '.join(f'{k:g}x' for k in ran)} the tokens (validation loss)"
    if any(r.multiplier is None for r in reached):
        return replace(figure, at_least=max(r.at_least for r in reached if r.multiplier is None), how=how)
    return replace(figure, multiplier=statistics.fmean(r.multiplier for r in reached), seeds=seeds, how=how)


def interval_of(point: str) -> Optional[int]:
    """H as a point's label names it (diloco-H100-avg: 100), None where it does not."""
    m = re.search(r"-H(\d+)(?:-|$)", point)
    return int(m.group(1)) if m else None


def at_interval(e: Evidence, key: str, interval: Optional[int]) -> Figure:
    """The file's figure for `key` at H = `interval` where it measured a multiplier or a bound
    there (budget points), else its best figure for `key` (which may be at another H: the
    caller labels it). The ladder measures diloco at H = 30 and 100; a row at H = 100 takes
    H = 100's figure once its budgets have run, not H = 30's closer one."""
    best = e.figures[key]
    if interval is None or interval_of(best.point) == interval:
        return best
    same = [f for p, f in e.points.items() if figure_key(f.algorithm, compression_of(p)) == key
            and interval_of(p) == interval and (f.multiplier is not None or f.at_least is not None)]
    if not same:
        return best
    chosen = same[0]
    for f in same[1:]:
        chosen = f if _better(f, chosen) else chosen
    return chosen


def _better(a: Figure, b: Figure) -> bool:
    if (a.multiplier is None) != (b.multiplier is None):
        return a.multiplier is not None
    if a.multiplier is not None:
        return a.multiplier < b.multiplier
    if (a.at_least is None) != (b.at_least is None):  # a lower bound measured says more than none
        return a.at_least is not None
    return a.final_gap < b.final_gap


def load_all(pattern: str) -> List[Evidence]:
    """Every quality JSON the pattern finds (results/quality*.json by default), sorted by path."""
    out = []
    for path in sorted(glob.glob(pattern)):
        out.append(read_evidence(path))
    return out


def distance(e: Evidence, params: float, tokens_per_param: float) -> Tuple[int, float]:
    """How far a measurement is from the user's regime: first the tokens per parameter (in
    factors of 2: the regime, which moved the gaps most, docs/quality.md), then the model size
    (log). Every measured model is 100x or more below a user's, so size alone would pick the
    largest toy at one token per parameter over the ladder at the user's 20."""
    return (math.floor(abs(math.log2(tokens_per_param / e.tokens_per_param))),
            abs(math.log10(params / e.params)))


def nearest(evidence: List[Evidence], algorithm: str, params: float, tokens_per_param: float) -> Optional[Evidence]:
    """The file nearest the user's regime that measured the algorithm: first by tokens per
    parameter (distance's regime), then one that measured the multiplier (or a lower bound on
    more tokens: budget points) before one that only saw it end above sync's loss, then by size.
    The ladder's rungs S and M share their regime and gaps (+3.2% and +3.4% for diloco), so
    rung S's measured multiplier says more of a user's time to sync's loss than rung M's "not
    reached"; the provenance line names the rung it came from."""
    have = [e for e in evidence if algorithm in e.figures or algorithm == "sync"]

    def key(e: Evidence):
        regime, size = distance(e, params, tokens_per_param)
        fig = e.figures.get(algorithm)
        unmeasured = fig is not None and fig.multiplier is None and fig.at_least is None
        return regime, unmeasured, size

    return min(have, key=key) if have else None


def far_beyond(e: Evidence, params: float, tokens_per_param: float) -> List[str]:
    """Why the user's target is far outside what this file measured (empty: it is not)."""
    reasons = []
    if params > FAR_FACTOR * e.params or params < e.params / FAR_FACTOR:
        reasons.append(f"model {params / 1e9:.3g}B params vs measured {e.params / 1e6:.2g}M "
                       f"({params / e.params:.3g}x)")
    ratio = tokens_per_param / e.tokens_per_param
    if ratio > FAR_FACTOR or ratio < 1 / FAR_FACTOR:
        reasons.append(f"{tokens_per_param:.3g} tokens/param vs measured {e.tokens_per_param:.3g}")
    return reasons
