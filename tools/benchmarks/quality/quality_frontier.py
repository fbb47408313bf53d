"""The quality frontier: cross-site bytes saved against validation loss, per algorithm x compressor.

Runs `sync` and every point of a sweep (an algorithm, a compressor and the few knobs that
matter: H, outer lr/momentum, alpha, density, rank, lambda, the inner optimizer; each
algorithm's points in its recipe, tools/benchmarks/recipes.py) for each
seed, at the same model, data, token budget and seed as `sync`, in `--sites` spawned
processes per run (tools/benchmarks/quality/lsgd_quality.py's runner). Each point is measured against
`sync` with the point's own inner optimizer (`--optimizer` and its flags): MuLoCo against
sync with Muon, so a gap is the algorithm's, not the optimizer's. For each point it reports

    bytes reduction = that sync's inter-site bytes / the point's (the logging rank's, as counted)
    gap             = final validation loss / that sync's of the same seed - 1

as mean and spread (min..max) over the seeds, marks each family's best point (lowest mean
gap over the seeds its points share; the measured default), and checks issue 24's goals
(>= 1000x within 2%, >= 100x within 0.5%). It writes the table between `<!-- frontier:begin -->` and `<!-- frontier:end -->`
of `--doc` (kept otherwise as is, created if missing), a PNG beside it (log x: bytes
reduction; y: gap, with the seeds' spread) and the raw results as JSON: for a page in docs/,
under results/ with the same path (docs/quality.md's is results/quality.json), beside it
elsewhere.

    python -m tools.bench frontier --data-path data/python-docs/python_docs_text_document \\
        --tokenizer-model data/python-docs/python_docs_sp8k.model --train-iters 3000 --seeds 1,2,3

The model-size ladder (docs/quality.md) is this tool with `--ladder S|M|L`: a rung's model,
sequence, batch and budget (tokens per parameter on docs-corpus, read once; the training file
used whole and `--valid-data-path` held out by document, see tools/prepare_corpus.py), the
ladder's points, and its page docs/quality-ladder-RUNG.md, its cells in results/runs/quality-ladder-RUNG:

    python -m tools.bench frontier --ladder S --seeds 1,2,3 \
        --data-path data/docs-corpus/docs_corpus_train_text_document \
        --valid-data-path data/docs-corpus/docs_corpus_valid_text_document \
        --tokenizer-model data/docs-corpus/docs_corpus_sp4k.model

`--points` picks the points to train by label or family (comma-separated; default all; with
`--ladder`, the rung's own points; the points run on request are `--points claims`, `--points
frontier`: issue 24's compressors on diloco-H30-avg and dilocox's int4, and `--points budget`:
diloco (H = 30 and 100) and streaming-diloco at 1.25x, 1.5x and 2x the tokens,
token_budgets.py). A rung's page
keeps every point of the catalogue that the cache holds, read from it and not trained, so any
`--points` run adds to the page and never drops what it did not train; `--point
LABEL=FAMILY:FLAGS` adds one. Each finished run is kept under `--cache-dir` (named by a
digest of its flags, with every argument they resolve to: one made under other defaults is
trained again; by default results/runs/<page>, committed with the page it is the data of), so a
sweep that stops is resumed by running the same command again, on any clone; move a run out
of the cache after a change of the code that alters training (or `--refresh` the points it
touches: each run records the commit it ran at, see run_cache.py). A run stopped midway
(Ctrl-C, the machine's session ending) keeps a checkpoint of every 500 steps under
CACHE_DIR/.partial/ (git-ignored), and the same command resumes it from the last one: a
ladder cell of an hour loses at most a few minutes (tools/benchmarks/resumable_runs.py).
`--cached-only` trains nothing and writes the table from what the cache holds. A run that
fails is reported and left out; the others go on. `--smoke` shrinks everything to a check that the pipeline runs
(tiny model, 20 iterations, mock data unless a corpus is given), which must not be read as
a measurement.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)

from megatron_lsgd.core.output_files import save_figure, write_json, write_text  # noqa: E402
from tools.benchmarks.quality.lsgd_quality import base_argv, data_argv, lockstep, passes_note, run  # noqa: E402
from tools.benchmarks.resumable_runs import PARTIAL  # noqa: E402
from tools.benchmarks.recipes import Point, points as recipe_points  # noqa: E402
from tools.benchmarks.quality.token_budgets import (BUDGET_BASES, BUDGET_SCALES, budget_label,  # noqa: E402
                                                   budget_points, budgets_of, reach_per_seed)
from tools.benchmarks.quality.token_budgets import FAMILY as BUDGET_FAMILY  # noqa: E402
from tools.benchmarks.run_cache import (SEEDS_HELP, load_or_run, positive_int, relative_flags,  # noqa: E402
                                        resolved_arguments, results_path, seed_list)
from tools.benchmarks.spawned_ranks import run_tool  # noqa: E402
from tools.benchmarks.tool_input import read_json_object  # noqa: E402

BEGIN, END = "<!-- frontier:begin -->", "<!-- frontier:end -->"


def markers(block: str):
    """The begin/end comments around a named block of a page ("frontier": BEGIN, END)."""
    return f"<!-- {block}:begin -->", f"<!-- {block}:end -->"
SYNC = ["--lsgd-algorithm", "sync"]
INNER_OPTIMIZER = ("--optimizer", "--muon-", "--adam-", "--sgd-")  # flags (each with one value) that pick it
GOALS = ((1000.0, 2.0), (100.0, 0.5))  # (bytes reduction at least, gap at most in %)


def default_points(interval: int, num_layers: int) -> List[Point]:
    """The sweep: per family, the knobs that matter (kept small: every point costs seeds x runs),
    each algorithm's in its recipe (recipes.py)."""
    return recipe_points("frontier", interval, num_layers)


# ---- the model-size ladder (docs/quality.md, "Quality where users train") ------------------------
@dataclass(frozen=True)
class Rung:
    """One size of the ladder: a Llama-style GPT (RMSNorm, RoPE, SwiGLU, tied embeddings, no biases)
    trained on docs-corpus read once at `tokens_per_parameter` tokens per (total) parameter."""
    name: str
    num_layers: int
    hidden_size: int
    tokens_per_parameter: int


LADDER = {r.name: r for r in (Rung("S", 2, 48, 20), Rung("M", 4, 96, 20), Rung("L", 6, 168, 10))}
LADDER_SEQ, LADDER_BATCH, LADDER_EVAL_ITERS = 256, 16, 40  # 4,096 tokens a step; 163,840 validation tokens
LADDER_VOCAB = 4096 + 5  # docs_corpus_sp4k: 4,096 pieces and Megatron's 5 specials


def padded_vocab(vocab: int, multiple: int = 128) -> int:
    return -(-vocab // multiple) * multiple


def ladder_parameters(rung: Rung, vocab: int = LADDER_VOCAB) -> Dict[str, int]:
    """Parameters of a rung's model: per layer QKV + projection (4 h^2), SwiGLU (3 h x ffn, ffn as
    TransformerConfig sets it: Llama's 8h/3 rounded up to 64) and two RMSNorm weights; the (tied)
    embedding at the padded vocabulary; the final norm."""
    from megatron_lsgd.core.transformer.config import TransformerConfig  # noqa: PLC0415

    h = rung.hidden_size
    ffn = TransformerConfig(num_layers=rung.num_layers, hidden_size=h, swiglu=True).ffn_hidden_size
    non_embedding = rung.num_layers * (4 * h * h + 3 * h * ffn + 2 * h) + h
    embedding = padded_vocab(vocab) * h
    return {"non_embedding": non_embedding, "embedding": embedding, "total": non_embedding + embedding}


def ladder_train_iters(rung: Rung) -> int:
    tokens = rung.tokens_per_parameter * ladder_parameters(rung)["total"]
    return -(-tokens // (LADDER_SEQ * LADDER_BATCH))


# Outer learning rates swept with Nesterov 0.9 at the smallest rung and carried to the others,
# as the DiLoCo scaling-law study does. 0.1 and 0.2 were added after 0.4-1.0 ended 7-27% above
# sync at rung S: at momentum 0.9 the steady-state step is lr / (1 - 0.9), 10x the outer lr.
LADDER_OUTER_LRS = (0.1, 0.2, 0.4, 0.7, 1.0)
# What rung S's sweep carried to the larger rungs (docs/quality.md: 0.4 was Nesterov's best at
# H = 30 and second at H = 100, 2 seeds; plain averaging beat every one of them)
CARRIED_OUTER_LRS = (0.4,)


def rung_points(rung: str) -> List[Point]:
    """A rung's default points: the whole outer-lr sweep at S, the carried outer lr elsewhere."""
    return ladder_points(LADDER_OUTER_LRS if rung == "S" else CARRIED_OUTER_LRS)


def ladder_points(outer_lrs: Sequence[float] = LADDER_OUTER_LRS) -> List[Point]:
    """Per rung: diloco at H = 30 and 100, plain averaging and Nesterov 0.9 at each outer lr;
    streaming-diloco and dilocox at H = 30 with their defaults otherwise (recipes.py). dilocox's
    comes last, as the ladder's pages and their JSON have listed it since before the recipes."""
    return sorted(recipe_points("ladder", outer_lrs), key=lambda pt: pt.flags[1] == "dilocox")


def ladder_claim_points() -> List[Point]:
    """The seed claims re-judged at a rung with >= 100 outer syncs (run with `--points claims`):
    cocodc's delay compensation against streaming-diloco at the same K and tau, and dpu's
    one-step delay (dpu with all its steps undelayed is sync bit for bit, docs/quality-one-pass.md).
    dilocox's one-round delay is judged against diloco-H30-avg, its undelayed form, in the
    ladder's own points."""
    return recipe_points("claims")


def ladder_frontier_points() -> List[Point]:
    """Issue 24's compressors at a rung (run with `--points frontier`): int4 at H = 30 and 100,
    topk-2bit (SparseLoCo), low-rank int4, MuLoCo on diloco with plain averaging, and dilocox's
    recommended int4 (recipes.py)."""
    return recipe_points("ladder_frontier")


def on_request_points(train_iters: int) -> List[Point]:
    """A rung's points that its default command does not train (claims, compressors, budgets):
    run with `--points FAMILY`, then kept on the rung's page from the cache."""
    return ladder_claim_points() + ladder_frontier_points() + budget_points(ladder_points(), train_iters)


def ladder_page(rung: str, docs_dir: str = os.path.join(ROOT, "docs")) -> str:
    return os.path.join(docs_dir, f"quality-ladder-{rung}.md")


def _rung_columns(rungs: Sequence[Rung]) -> List[str]:
    """The header of a table with a row per point and a column per rung."""
    return ["| point | " + " | ".join(f"rung {r.name}" for r in rungs) + " |", "|---|" + "---|" * len(rungs)]


def _median_range(values: Sequence[float]) -> str:
    return f"{statistics.median(values):+.2f}% [{min(values):+.2f}, {max(values):+.2f}]"


def page_json(doc: str, block: str = "frontier") -> str:
    """The raw results of a page's block: quality.json for quality.md (another block of the same
    page has its own, quality-NAME.json), under results/ for a page in docs/ (run_cache.results_path)."""
    base = os.path.splitext(doc)[0] + ("" if block == "frontier" else f"-{block}")
    return results_path(base) + ".json"


def ladder_summary(docs_dir: str = os.path.join(ROOT, "docs")) -> str:
    """The ladder's table from each rung's page JSON (quality-ladder-RUNG.json, written by
    `--ladder RUNG`; results/ holds those of docs/'s pages): per point and rung, the gap to sync
    of the same seed as median [min, max] over the seeds run, the seeds, and per rung its model,
    budget, outer steps and sync's loss."""
    rungs = [r for r in LADDER.values() if os.path.exists(page_json(ladder_page(r.name, docs_dir)))]
    if not rungs:
        return "No rung has finished runs yet (run `quality_frontier.py --ladder S ...`)."
    data = {}
    for r in rungs:
        data[r.name] = read_json_object(page_json(ladder_page(r.name, docs_dir)),
                                        "ladder page", "write it again with --ladder RUNG --cached-only")
    lines = ["| rung | layers x hidden | parameters (non-embedding) | tokens per parameter | steps "
             "(outer steps at H = 30 / 100) | sync's validation loss | seeds |", "|---|---|---|---|---|---|---|"]
    for r in rungs:
        n, iters = ladder_parameters(r), ladder_train_iters(r)
        sync = data[r.name]["sync"].get(reference_name(SYNC), {})
        losses = [run["valid"][-1] for run in sync.values()]
        loss = f"{statistics.median(losses):.4f}" if losses else "-"
        lines.append(f"| {r.name} | {r.num_layers} x {r.hidden_size} | {n['total'] / 1e6:.2f}M "
                     f"({n['non_embedding'] / 1e6:.3f}M) | {r.tokens_per_parameter} | {iters} ({iters // 30} / "
                     f"{iters // 100}) | {loss} | {len(losses)} |")
    lines += ["", "Gap of the final validation loss to sync's of the same seed (with Muon for muloco: the same inner "
                  "optimizer): median [min, max] over the seeds "
                  "(their number after the slash); docs-corpus read once, validation on 163,840 tokens of held-out "
                  "documents.", "",
              *_rung_columns(rungs)]
    longer = []  # budget points: their own table, as on a rung's page (not at sync's tokens)
    for pt in ladder_points() + on_request_points(1):
        if pt not in ladder_points() and not any(data[r.name]["results"].get(pt.label) for r in rungs):
            continue  # a point on request not run at any rung: no row
        cells = []
        for r in rungs:
            runs = data[r.name]["results"].get(pt.label, {})
            sync = data[r.name]["sync"].get(reference_of(pt), {})  # MuLoCo's: sync with Muon
            gaps = [100.0 * (run["valid"][-1] / sync[seed]["valid"][-1] - 1.0) for seed, run in runs.items()
                    if seed in sync]
            cells.append(f"{_median_range(gaps)} /{len(gaps)}" if gaps else "not run")
        (longer if pt.family == BUDGET_FAMILY else lines).append(f"| {pt.label} | " + " | ".join(cells) + " |")
    if longer:
        lines += ["", "The same gap for the budget points, trained on more tokens than sync (1.25x, 1.5x, 2x; "
                      "tools/benchmarks/quality/token_budgets.py):", "",
                  *_rung_columns(rungs)]
        lines += longer
    reach = tokens_to_reach_table(rungs, data)
    return "\n".join(lines + (["", reach] if reach else []))


def tokens_to_reach_table(rungs: Sequence[Rung], data: Dict[str, Dict]) -> str:
    """Per budget base and rung, the tokens it needs to reach sync's final validation loss over
    sync's (token_budgets.reach_per_seed; median [min, max] over the seeds), or "> S" when no
    scale a seed ran reached it. Empty before any budget ran."""
    rows = []
    for base in BUDGET_BASES:
        cells, any_run = [], False
        for r in rungs:
            results, sync = data[r.name]["results"], data[r.name]["sync"].get(reference_name(SYNC), {})
            scales = {1.0: results.get(base, {}), **{s: results.get(budget_label(base, s), {}) for s in BUDGET_SCALES}}
            any_run |= any(scales[s] for s in BUDGET_SCALES)
            reached = list(reach_per_seed(scales, sync).values())
            if not reached:
                cells.append("not run")
            elif any(x.multiplier is None for x in reached):
                cells.append(f"> {max(x.at_least for x in reached if x.multiplier is None):g}x on "
                             f"{sum(x.multiplier is None for x in reached)} of {len(reached)} seeds")
            else:
                m = [x.multiplier for x in reached]
                cells.append(f"{statistics.median(m):.2f}x [{min(m):.2f}, {max(m):.2f}] /{len(m)}")
        if any_run:
            rows.append(f"| {base} | " + " | ".join(cells) + " |")
    if not rows:
        return ""
    return "\n".join([f"Tokens to reach sync's final validation loss, over sync's: each point trained again on "
                      f"{', '.join(f'{s:g}x' for s in BUDGET_SCALES)} the tokens with its schedule stretched, "
                      f"interpolated between the budgets that bracket sync's loss (linearly in log tokens; "
                      f"tools/benchmarks/quality/token_budgets.py); median [min, max] over the seeds (after the "
                      f"slash).", "", *_rung_columns(rungs)] + rows)


SMOKE_DIR = os.path.join(ROOT, "runs", "quality_smoke")  # ignored: a smoke run measures nothing


def default_doc(smoke: bool, rung: Optional[str] = None) -> str:
    """docs/quality.md, or a rung's docs/quality-ladder-RUNG.md; a smoke run writes its table
    under SMOKE_DIR instead of over the page's (a ladder smoke once overwrote rung S's page)."""
    name = "quality.md" if rung is None else os.path.basename(ladder_page(rung))
    return os.path.join(SMOKE_DIR if smoke else os.path.join(ROOT, "docs"), name)


def default_cache_dir(doc: str, smoke: bool) -> str:
    """Where a page's finished runs are kept: results/runs/quality-one-pass for
    docs/quality-one-pass.md (runs/<page> beside a page outside docs/), committed with it, so
    the page can be regenerated and grown (more seeds, more points) from any clone instead of
    training its hours of runs again; a smoke run's, which measure nothing, under the ignored runs/."""
    if smoke:
        return SMOKE_DIR
    data = os.path.dirname(results_path(os.path.abspath(doc)))
    return os.path.join(data, "runs", os.path.splitext(os.path.basename(doc))[0])


def reference_flags(flags: Sequence[str]) -> List[str]:
    """The sync run a point is measured against: `sync` with the point's inner-optimizer flags."""
    out = list(SYNC)
    for i, flag in enumerate(flags[:-1]):
        if flag.startswith(INNER_OPTIMIZER):
            out += [flag, flags[i + 1]]
    return out


def reference_name(ref: Sequence[str]) -> str:
    return " ".join(["sync"] + list(ref[len(SYNC):]))


def reference_of(point: Point) -> str:
    """The name of the sync run `point` is measured against."""
    return reference_name(reference_flags(point.flags))


def parse_point(text: str) -> Point:
    label, _, rest = text.partition("=")
    family, _, flags = rest.partition(":")
    if not label or not family or "--lsgd-algorithm" not in flags:
        raise ValueError(f"--point {text!r}: write LABEL=FAMILY:FLAGS, FLAGS naming --lsgd-algorithm")
    return Point(label, family, shlex.split(flags))


def select(points: List[Point], wanted: Optional[str]) -> List[Point]:
    if not wanted:
        return points
    names = wanted.split(",")
    unknown = [n for n in names if not any(n in (p.label, p.family) for p in points)]
    if unknown:
        raise ValueError(f"--points: {', '.join(unknown)} is neither a point nor a family "
                         f"({', '.join(sorted({p.family for p in points}))})")
    return [p for p in points if p.label in names or p.family in names]


# ---- aggregation (pure: tested on its own) -------------------------------------------------------
@dataclass
class Summary:
    point: Point
    reduction: float  # sync bytes / bytes, mean over seeds
    gaps: List[float] = field(default_factory=list)  # % per seed
    seeds: List[int] = field(default_factory=list)  # the seeds of `gaps`, in order

    @property
    def gap(self) -> float:
        return statistics.fmean(self.gaps)


def summarize(points: Sequence[Point], results: Dict[str, Dict[int, Dict]],
              sync: Dict[str, Dict[int, Dict]]) -> List[Summary]:
    """results[label][seed] and sync[reference_name][seed]: {"valid": [...], "comm": {"bytes_sent": ...}},
    each point against the sync run with its inner optimizer (`reference_flags`). A point with
    no finished run (every seed failed) has no summary."""
    out = []
    for p in points:
        gaps, ratios = [], []
        if not results.get(p.label):
            continue
        for seed, r in sorted(results[p.label].items()):
            ref = sync[reference_of(p)][seed]
            gaps.append(100.0 * (r["valid"][-1] / ref["valid"][-1] - 1.0))
            sent = r["comm"].get("bytes_sent", 0)
            ratios.append(ref["comm"]["bytes_sent"] / sent if sent else float("inf"))
        out.append(Summary(p, statistics.fmean(ratios), gaps, sorted(results[p.label])))
    return out


THROUGH = (0.1, 0.25, 0.5, 0.6, 0.75, 0.9, 1.0)  # fractions of a run at which gaps_through_training reads


def _loss_at(curve: Sequence[float], fraction: float) -> float:
    """The logged training loss at `fraction` of the run: the mean over the 2% of the logged
    points that end there (one logged loss is one batch's, noisy)."""
    end = max(1, round(fraction * len(curve)))
    width = max(1, round(0.02 * len(curve)))
    return statistics.fmean(curve[max(0, end - width):end])


def gaps_through_training(points: Sequence[Point], results: Dict[str, Dict[int, Dict]],
                          sync: Dict[str, Dict[int, Dict]], fractions: Sequence[float] = THROUGH) -> str:
    """When each gap opens: the point's training loss against its sync's of the same seed (the
    same batches at the same step) at fractions of the run, median over the seeds. Empty when
    no run logged a training curve."""
    rows = []
    for p in points:
        runs = results.get(p.label) or {}
        per_seed = []
        for seed, r in sorted(runs.items()):
            ref = sync[reference_of(p)].get(seed)
            if ref and r.get("train") and ref.get("train") and len(r["train"]) == len(ref["train"]):
                per_seed.append([100.0 * (_loss_at(r["train"], f) / _loss_at(ref["train"], f) - 1.0)
                                 for f in fractions])
        if per_seed:
            cells = [statistics.median(column) for column in zip(*per_seed)]
            rows.append(f"| {p.label} | " + " | ".join(f"{c:+.2f}%" for c in cells) + f" | {len(per_seed)} |")
    if not rows:
        return ""
    head = "| point | " + " | ".join(f"{round(100 * f)}%" for f in fractions) + " | seeds |"
    return "\n".join(["Gap of the training loss to sync's through the run (the same batches at the same step; the "
                      "mean of the last 2% of logged losses up to each fraction of the steps; median over the seeds):",
                      "", head, "|---|" + "---|" * (len(fractions) + 1)] + rows)


def cached_run(argv: List[str], sites: int, cache_dir: str, cached_only: bool = False,
               refresh: bool = False) -> Optional[Dict]:
    """One run's result, from the cache or trained now and cached (None: it failed, its error
    printed and the sweep going on; or it is not cached and `cached_only`). `refresh` trains it
    again even if cached. A run stopped midway resumes from its last checkpoint, kept under
    CACHE_DIR/.partial/DIGEST (git-ignored) until it finishes (resumable_runs.py)."""
    digest = _digest(argv, sites)

    def train() -> Optional[Dict]:
        if cached_only:
            print("  not in the cache (--cached-only): left out", flush=True)
            return None
        try:
            return run(argv, sites, work_dir=os.path.join(cache_dir, PARTIAL, digest))
        except Exception as err:  # a rank failed: its error line is above
            print(f"error: this run failed ({err}); it is left out of the table", flush=True)
            return None

    return load_or_run(cached_path(argv, sites, cache_dir), train, refresh=refresh and not cached_only,
                       resolved=resolved_arguments(argv))


def _digest(argv: List[str], sites: int) -> str:
    return hashlib.sha256(json.dumps([sites] + relative_flags(argv)).encode()).hexdigest()[:16]


def cached_path(argv: List[str], sites: int, cache_dir: str) -> str:
    """Where the run of `argv` is (or would be) cached."""
    return os.path.join(cache_dir, f"{_digest(argv, sites)}.json")


def best_per_family(summaries: Sequence[Summary]) -> Dict[str, Summary]:
    """Per family, the point with the lowest mean gap over the seeds every point of the family
    has (a point with one lucky seed does not beat one averaged over three); a family with no
    seed in common is ranked on each point's own mean."""
    families: Dict[str, List[Summary]] = {}
    for s in summaries:
        families.setdefault(s.point.family, []).append(s)
    best: Dict[str, Summary] = {}
    for family, members in families.items():
        common = set.intersection(*(set(m.seeds) for m in members))

        def score(m: Summary) -> float:
            if not common:
                return m.gap
            return statistics.fmean(g for g, seed in zip(m.gaps, m.seeds) if seed in common)

        best[family] = min(members, key=score)  # ties: the first listed
    return best


def goals_met(summaries: Sequence[Summary]) -> List[str]:
    lines = []
    for reduction, gap in GOALS:
        hits = [s for s in summaries if s.reduction >= reduction and max(s.gaps) <= gap]
        who = ", ".join(f"{s.point.label} ({s.reduction:.0f}x, {s.gap:+.2f}%)" for s in hits) or "none"
        lines.append(f"- >= {reduction:.0f}x fewer bytes within {gap}% of sync (same inner optimizer) on every "
                     f"seed: {who}")
    return lines


def at_equal_tokens(summaries: Sequence[Summary]) -> List[Summary]:
    """The frontier's points: trained on the reference's tokens. A budget point trained on more
    (token_budgets.py) is not on it: its loss bought with more compute would read as a gain."""
    return [s for s in summaries if s.point.family != BUDGET_FAMILY]


def table(summaries: Sequence[Summary], header: str) -> str:
    longer = [s for s in summaries if s.point.family == BUDGET_FAMILY]
    summaries = at_equal_tokens(summaries)
    best = {id(s) for s in best_per_family(summaries).values()}
    lines = [header, "", "| point | family | against | bytes reduction | gap (mean) | gap spread (min..max) | seeds |",
             "|---|---|---|---|---|---|---|"]
    for s in sorted(summaries, key=lambda s: (s.point.family, s.gap)):
        mark = " **best**" if id(s) in best else ""
        lines.append(f"| {s.point.label}{mark} | {s.point.family} | {reference_of(s.point)} | "
                     f"{s.reduction:.3g}x | {s.gap:+.2f}% | {min(s.gaps):+.2f}% .. {max(s.gaps):+.2f}% | "
                     f"{len(s.gaps)} |")
    lines += ["", "Goals (issue 24):"] + goals_met(summaries)
    if longer:
        lines += ["", "Trained on more tokens than sync (budget points, tools/benchmarks/quality/token_budgets.py: "
                      "not at equal tokens, so neither on the frontier nor in the goals):", "",
                  "| point | gap of the final validation loss (mean) | gap spread (min..max) | seeds |",
                  "|---|---|---|---|"]
        lines += [f"| {s.point.label} | {s.gap:+.2f}% | {min(s.gaps):+.2f}% .. {max(s.gaps):+.2f}% | {len(s.gaps)} |"
                  for s in sorted(longer, key=lambda s: s.point.label)]
    lines += ["", "Flags per point: " + "; ".join(f"{s.point.label}: `{' '.join(s.point.flags)}`"
                                                  for s in summaries + longer)]
    return "\n".join(lines)


def references_line(sync: Dict[str, Dict[int, Dict]]) -> str:
    """Each reference's mean final validation loss; those after the first also as a gap to it
    (what their inner optimizer alone gains or loses), over the seeds both finished."""
    names = [n for n in sync if sync[n]]
    first = names[0]
    parts = []
    for name in names:
        runs = sync[name]
        text = f"`{name}` {statistics.fmean(r['valid'][-1] for r in runs.values()):.4f}"
        common = [s for s in runs if s in sync[first]]
        if name != first and common:
            gap = statistics.fmean(100.0 * (runs[s]["valid"][-1] / sync[first][s]["valid"][-1] - 1) for s in common)
            text += f" ({gap:+.2f}% vs `{first}`)"
        parts.append(text)
    return ", ".join(parts) + " (final validation loss, mean over seeds)"


def published(runs: Dict[str, Dict[int, Dict]]) -> Dict[str, Dict[int, Dict]]:
    """Runs as the doc's JSON shows them: without the cache's record of resolved arguments."""
    return {name: {seed: {k: v for k, v in run.items() if k != "resolved"} for seed, run in by_seed.items()}
            for name, by_seed in runs.items()}


def write_block(doc: str, block: str, name: str = "frontier") -> None:
    """Replace the text between the markers of block `name` in `doc` (append them if absent)."""
    begin, end = markers(name)
    text = open(doc).read() if os.path.exists(doc) else "# Quality frontier\n"
    body = f"{begin}\n{block}\n{end}"
    if begin in text and end in text:
        text = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: body, text, flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n" + body + "\n"
    write_text(doc, text)


def plot(summaries: Sequence[Summary], path: str, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for family in sorted({s.point.family for s in summaries}):
        pts = [s for s in summaries if s.point.family == family]
        xs = [s.reduction for s in pts]
        ys = [s.gap for s in pts]
        err = [[s.gap - min(s.gaps) for s in pts], [max(s.gaps) - s.gap for s in pts]]
        ax.errorbar(xs, ys, yerr=err, fmt="o", capsize=3, label=family)
    for reduction, gap in GOALS:
        ax.plot([reduction], [gap], marker="*", color="black", markersize=10)
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("cross-site bytes reduction vs sync (log)")
    ax.set_ylabel("validation-loss gap to sync (%)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    return True


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-path", default=None,
                   help="a .bin/.idx prefix: split by --split 98,2,0, or with --valid-data-path the training file "
                        "used whole")
    p.add_argument("--valid-data-path", default=None,
                   help="a held-out .bin/.idx prefix (e.g. prepare_corpus.py's valid split): --data-path is then "
                        "the training set, used whole")
    p.add_argument("--tokenizer-model", default=None)
    p.add_argument("--ladder", choices=sorted(LADDER), default=None,
                   help="a rung of the model-size ladder: its model, sequence, batch, token budget (tokens per "
                        "parameter, read once), its points (default) and its page docs/quality-ladder-RUNG.md")
    p.add_argument("--ladder-summary", action="store_true",
                   help="train nothing: write the ladder's table (every rung's finished page JSON) into --doc's "
                        "block `ladder` (default docs/quality.md)")
    p.add_argument("--doc", default=None,
                   help="Markdown file whose frontier block is rewritten (PNG beside it, JSON too unless it is "
                        "in docs/: then under results/, same path; default docs/quality.md, with --smoke "
                        "runs/quality_smoke/quality.md)")
    p.add_argument("--block", default="frontier",
                   help="the named block of --doc to rewrite (between <!-- NAME:begin --> and <!-- NAME:end -->)")
    p.add_argument("--header-note", default="", help="a sentence added to the table's header (e.g. date and device)")
    p.add_argument("--sites", type=positive_int, default=2)
    p.add_argument("--seeds", type=seed_list, default=seed_list("3"), help=SEEDS_HELP)
    p.add_argument("--train-iters", type=positive_int, default=3000)
    p.add_argument("--interval", type=positive_int, default=50, help="H of the points that do not set their own")
    p.add_argument("--num-layers", type=positive_int, default=4)
    p.add_argument("--hidden-size", type=positive_int, default=128)
    p.add_argument("--seq-length", type=positive_int, default=128)
    p.add_argument("--global-batch-size", type=positive_int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-iters", type=positive_int, default=20)
    p.add_argument("--points", default=None,
                   help="labels or families to run (default: all; with --ladder, the rung's own points, and on "
                        "request the families claims, frontier (issue 24's compressors) and budget (more tokens); "
                        "a rung's page keeps every point its cache holds)")
    p.add_argument("--point", action="append", default=[], metavar="LABEL=FAMILY:FLAGS", help="add a point")
    p.add_argument("--extra-args", default="", help="flags for every run")
    p.add_argument("--smoke", action="store_true", help="tiny, fast: checks the pipeline, measures nothing")
    p.add_argument("--cache-dir", default=None,
                   help="finished runs, reused by the next sweep with the same flags (default: runs/<name of --doc> "
                        "in --doc's directory, under results/ for a page in docs/: results/runs/quality for "
                        "docs/quality.md, committed with the page it is the data of; runs/quality_smoke with "
                        "--smoke)")
    p.add_argument("--refresh", action="store_true",
                   help="train the selected points again even if cached (not the sync references), e.g. after a "
                        "change of the code that alters them (a changed default is caught by the resolved arguments)")
    p.add_argument("--cached-only", action="store_true",
                   help="train nothing: write the table from the finished runs in --cache-dir (a point's seeds "
                        "that are not there are left out; the seeds column says how many it has)")
    args = p.parse_args(argv)
    if args.ladder_summary:
        doc = args.doc or os.path.join(ROOT, "docs", "quality.md")
        block = ladder_summary(os.path.dirname(os.path.abspath(doc)))
        write_block(doc, block, "ladder")
        print(block)
        print(f"wrote {doc} (block ladder)")
        return
    if args.ladder is not None:
        rung = LADDER[args.ladder]
        args.num_layers, args.hidden_size, args.seq_length = rung.num_layers, rung.hidden_size, LADDER_SEQ
        args.global_batch_size, args.eval_iters = LADDER_BATCH, LADDER_EVAL_ITERS
        args.train_iters = ladder_train_iters(rung)
        if args.doc is None:
            args.doc = default_doc(args.smoke, rung.name)
    if args.doc is None:
        args.doc = default_doc(args.smoke)
    if args.cache_dir is None:
        args.cache_dir = default_cache_dir(args.doc, args.smoke)
    if args.smoke:
        args.train_iters, args.num_layers, args.hidden_size, args.seq_length = 20, 2, 64, 32
        args.global_batch_size, args.eval_iters, args.interval = 8, 2, 10
    try:
        seeds = args.seeds
        catalogue = ladder_points() + on_request_points(args.train_iters) \
            if args.ladder is not None else default_points(args.interval, args.num_layers)
        wanted = args.points
        if wanted is None and args.ladder is not None:  # the rung's own points; claims and budgets on request
            wanted = ",".join([pt.label for pt in rung_points(args.ladder)] + [t.partition("=")[0] for t in args.point])
        points = select(catalogue + [parse_point(t) for t in args.point], wanted)
        for pt in points:
            if pt.flags == reference_flags(pt.flags):
                raise ValueError(f"--point {pt.label}: its flags are its own reference (sync with its inner "
                                 f"optimizer), which every sweep runs and the header reports")
    except ValueError as err:
        p.error(str(err))
    try:
        data, label = data_argv(args.data_path, args.tokenizer_model, args.valid_data_path)
    except ValueError as err:
        p.error(str(err))

    def argv_for(flags: List[str], seed: int) -> List[str]:
        argv = base_argv(num_layers=args.num_layers, hidden_size=args.hidden_size, seq_length=args.seq_length,
                         global_batch_size=args.global_batch_size, train_iters=args.train_iters, lr=args.lr,
                         eval_interval=0, eval_iters=args.eval_iters, sites=args.sites, data=data,
                         extra=shlex.split(args.extra_args), seed=seed) + flags
        if not lockstep(argv):  # sites take different numbers of steps: the same budget, in samples
            i = argv.index("--train-iters")
            argv = argv[:i] + ["--train-samples", str(args.train_iters * args.global_batch_size)] + argv[i + 2:]
        return argv

    kept: List[str] = []  # points read from the cache only (never trained by this command)
    if args.ladder is not None:
        # the rung's page is its record: every point it has run stays on it and in its JSON, whatever
        # this command trains (a point run on request; the rung's own points under --points budget,
        # which once left the page with the budgets alone until a --cached-only)
        kept = [pt.label for pt in catalogue if pt not in points
                and any(os.path.exists(cached_path(argv_for(pt.flags, seed), args.sites, args.cache_dir))
                        for seed in seeds)]
        points += [pt for pt in catalogue if pt.label in kept]
    references = [SYNC] + [list(r) for r in dict.fromkeys(tuple(reference_flags(pt.flags)) for pt in points)
                           if list(r) != SYNC]
    # a reference only kept points use (sync with Muon for a kept MuLoCo) is read, never trained
    trained_refs = {tuple(SYNC)} | {tuple(reference_flags(pt.flags)) for pt in points if pt.label not in kept}

    t0 = time.perf_counter()
    sync: Dict[str, Dict[int, Dict]] = {reference_name(ref): {} for ref in references}
    results: Dict[str, Dict[int, Dict]] = {pt.label: {} for pt in points}
    for seed in seeds:
        for ref in references:
            print(f"> {reference_name(ref)}, seed {seed}", flush=True)
            reference = cached_run(argv_for(list(ref), seed), args.sites, args.cache_dir,
                                   args.cached_only or tuple(ref) not in trained_refs)
            if reference is not None:
                sync[reference_name(ref)][seed] = reference
            elif not args.cached_only:
                print(f"error: {reference_name(ref)} failed for seed {seed}: its points' runs of that seed are "
                      f"left out", flush=True)
        for pt in points:
            if seed not in sync[reference_of(pt)]:
                continue
            print(f"> {pt.label}, seed {seed}", flush=True)
            result = cached_run(argv_for(pt.flags, seed), args.sites, args.cache_dir,
                                args.cached_only or pt.label in kept, args.refresh)
            if result is not None:
                results[pt.label][seed] = result
    if not sync[reference_name(SYNC)]:
        sys.exit("error: sync has no finished run for any seed (failed, or not in the cache with --cached-only); "
                 "nothing to compare against")
    summaries = summarize(points, results, sync)
    failed = [pt.label for pt in points if not results[pt.label]]
    # the page's PNG beside it, its JSON under results/ (page_json); another block of the same page has its own
    base = os.path.splitext(args.doc)[0] + ("" if args.block == "frontier" else f"-{args.block}")
    raw = page_json(args.doc, args.block)
    os.makedirs(os.path.dirname(os.path.abspath(args.doc)), exist_ok=True)
    os.makedirs(os.path.dirname(os.path.abspath(raw)), exist_ok=True)
    # the ladder's model as built (tools/planning/evidence.py reads it: the tokenizer is not in argv's terms)
    model = {"model_parameters": ladder_parameters(LADDER[args.ladder])} if args.ladder is not None else {}
    # a budget point's base and scale of the tokens (token_budgets.py: the planner's multipliers)
    budgets = {"budgets": budgets_of(points)} if budgets_of(points) else {}
    write_json(raw, {"label": label, "argv": argv_for([], seeds[0]), **model, "sync": published(sync),
                     "results": published(results), **budgets}, indent=1)
    passes = passes_note(args.data_path, args.train_iters * args.global_batch_size, args.seq_length,
                         whole=args.valid_data_path is not None)
    if args.ladder is not None:
        n = ladder_parameters(LADDER[args.ladder])
        passes += (f"; ladder rung {args.ladder}: {n['total']:,} parameters ({n['non_embedding']:,} non-embedding), "
                   f"{args.train_iters * args.global_batch_size * args.seq_length / n['total']:.1f} tokens per "
                   f"parameter")
    header = (f"Data: {label}{passes}{' (SMOKE RUN: measures nothing)' if args.smoke else ''}. {args.sites} sites, "
              f"{args.train_iters} iterations x {args.global_batch_size} x {args.seq_length} tokens, "
              f"{args.num_layers} layers x {args.hidden_size}, seeds {','.join(map(str, args.seeds))}. "
              f"Each point against sync with its "
              f"inner optimizer: {references_line(sync)}. Bytes: the logging rank's inter-site bytes sent, as "
              f"counted. " + ("Written from the cache." if args.cached_only else f"{time.perf_counter() - t0:.0f} s in all."))
    block = table(summaries, (args.header_note + " " if args.header_note else "") + header)
    through = gaps_through_training(points, results, sync)
    if through:
        block += "\n\n" + through
    if failed:
        block += "\n\nNo finished run (" + ("not in the cache" if args.cached_only else "every seed failed") + \
            "): " + ", ".join(failed)
    png = base + ".png"
    if plot(at_equal_tokens(summaries), png, label):
        block += f"\n\n![frontier]({os.path.basename(png)})"
    write_block(args.doc, block, args.block)
    print(block)
    print(f"wrote {args.doc}, {raw}" + (f", {png}" if os.path.exists(png) else ""))


if __name__ == "__main__":
    run_tool(main, "finished runs are kept in the cache and a run stopped midway keeps its last checkpoint; the same command resumes both")
