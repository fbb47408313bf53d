"""Turn `--json-log` files of benchmark runs into results.json, a Markdown table and plots.

    python -m tools.bench wan report OUT_DIR  # re-report a wan_bench run from its logs

OUT_DIR holds the table (results.md) and the plots; results.json and logs/ are measured data,
kept under results/ with the same path when OUT_DIR is in docs/ (docs/benchmarks/default's in
results/benchmarks/default: run_cache.results_path), in OUT_DIR itself anywhere else.

A run's log holds one record per log interval and a final {"event": "done"} record
(megatron_lsgd/training/training.py). The first `warmup_intervals` intervals are left out
of rate and exposed-communication figures (process-group connection set-up and
first-touch allocation land there); bytes and losses use every interval.

Two rates per run: updates/s (optimizer steps per second: progress, the table's headline)
and tokens/s (work done). They tell different stories when an algorithm changes its batch:
acco/dpu's adaptive accumulation adds micro-batches while the link is busy, so tokens/s can
match the ceiling while updates come several times slower. Beside them, the wall-clock time
at which the training loss reaches sync's final loss.

A non-lockstep run (A-EDiT) has sites taking different numbers of steps: each site's last
rank logs its own records, tagged with `"site"` and counting that site's tokens. Its sites
run at the same time, so the job's tokens/s is the sum of the sites' (as for the
ceiling) and its updates/s the mean of theirs; see `summarize`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
from megatron_lsgd.core.output_files import WriteError, save_figure, write_json, write_text  # noqa: E402
from tools.benchmarks.run_cache import results_path  # noqa: E402
from tools.benchmarks.tool_input import ToolInputError, read_json_object  # noqa: E402

CEILING = "ceiling"


def read_log(path: str) -> List[dict]:
    """The records of a JSON-lines log; a damaged line names the file and the line."""
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ToolInputError(f"log {path} line {number} is damaged ({err.msg})") from None
            if not isinstance(record, dict):
                raise ToolInputError(f"log {path} line {number} holds a JSON {type(record).__name__}, not an object")
            records.append(record)
    return records


def summarize(records: Sequence[dict], warmup_intervals: int = 1) -> dict:
    """Metrics of one job from its JSON log (per-site records are combined: `combine_sites`)."""
    sites = sorted({r["site"] for r in records if "site" in r})
    if sites:
        return combine_sites([_summarize_one([r for r in records if r.get("site") == s], warmup_intervals)
                              for s in sites])
    return _summarize_one(records, warmup_intervals)


def _summarize_one(records: Sequence[dict], warmup_intervals: int) -> dict:
    intervals = [r for r in records if r.get("event") != "done"]
    done = next((r for r in records if r.get("event") == "done"), {})
    if not intervals:
        raise ValueError("the run logged no interval (did it fail? see its .log)")
    timed = intervals[warmup_intervals:] or intervals[-1:]
    iters = sum(r["interval_iters"] for r in timed)
    all_iters = sum(r["interval_iters"] for r in intervals)
    timed_s = sum(r["elapsed_s"] for r in timed)
    tokens = sum(r["tokens"] for r in intervals)
    return {
        "tokens_per_s": sum(r["tokens"] for r in timed) / timed_s,
        # progress: optimizer steps per second (an algorithm that grows its batch computes
        # more tokens per step, so its tokens/s can rise while its updates/s falls)
        "updates_per_s": iters / timed_s,
        "updates": intervals[-1]["iteration"],
        "tokens_trained": tokens,
        "tokens_per_update": tokens / all_iters,
        # the whole run, start-up and the wait for a last in-flight update included
        "run_wall_s": done.get("wall_s", intervals[-1]["wall_s"]),
        "exposed_comm_s_per_step": sum(r["exposed_comm_s"] for r in timed) / iters,
        "inter_site_bytes_per_step": sum(r["inter_site_bytes"] for r in intervals) / all_iters,
        "loss": intervals[-1]["losses"].get("lm loss"),
        "peak_rss_mb": done.get("peak_rss_mb"),
        "iterations": intervals[-1]["iteration"],
        "curve": [{"iteration": r["iteration"], "wall_s": r["wall_s"], "tokens": t, "loss": r["losses"].get("lm loss")}
                  for r, t in zip(intervals, _cumulative(r["tokens"] for r in intervals))],
    }


def _cumulative(values) -> List[float]:
    out, total = [], 0.0
    for v in values:
        total += v
        out.append(total)
    return out


def combine_sites(per_site: Sequence[dict]) -> dict:
    """The sites of one non-lockstep job (each site's own records): they ran at the same time,
    so throughputs add up; exposed communication and bytes are per site step (averaged over
    sites); the loss is the mean of the sites' last logged losses (their own models between
    syncs); the curve merges every site's points in wall-clock order (tokens of all sites so
    far, mean of each site's latest loss)."""
    events = sorted((p["wall_s"], i, p) for i, s in enumerate(per_site) for p in s["curve"])
    latest: Dict[int, float] = {}
    done_tokens: Dict[int, float] = {}
    curve = []
    for wall, i, p in events:
        latest[i], done_tokens[i] = p["loss"], p["tokens"]
        if len(latest) == len(per_site) and all(v is not None for v in latest.values()):
            curve.append({"iteration": p["iteration"], "wall_s": wall, "tokens": sum(done_tokens.values()),
                          "loss": sum(latest.values()) / len(latest)})
    losses = [s["loss"] for s in per_site if s["loss"] is not None]
    return {
        "tokens_per_s": sum(s["tokens_per_s"] for s in per_site),
        **_per_site_progress(per_site),
        "exposed_comm_s_per_step": sum(s["exposed_comm_s_per_step"] for s in per_site) / len(per_site),
        "inter_site_bytes_per_step": sum(s["inter_site_bytes_per_step"] for s in per_site) / len(per_site),
        "loss": sum(losses) / len(losses) if losses else None,
        "peak_rss_mb": max((s["peak_rss_mb"] or 0) for s in per_site) or None,
        "iterations": max(s["iterations"] for s in per_site),
        "site_iterations": [s["iterations"] for s in per_site],
        "site_tokens_per_s": [s["tokens_per_s"] for s in per_site],
        "curve": curve,
    }


def combine_ceiling(per_site: Sequence[dict]) -> dict:
    """Every site trained alone at the same time: throughputs add up; the loss is the mean of
    the sites' own models (each saw 1/S of the tokens); memory is the largest."""
    curves = [s["curve"] for s in per_site]
    curve = [{"iteration": pts[0]["iteration"], "wall_s": max(p["wall_s"] for p in pts),
              "tokens": sum(p["tokens"] for p in pts), "loss": sum(p["loss"] for p in pts) / len(pts)}
             for pts in zip(*curves)]
    return {
        "tokens_per_s": sum(s["tokens_per_s"] for s in per_site),
        **_per_site_progress(per_site),
        "exposed_comm_s_per_step": 0.0,
        "inter_site_bytes_per_step": 0.0,
        "loss": sum(s["loss"] for s in per_site) / len(per_site),
        "peak_rss_mb": max((s["peak_rss_mb"] or 0) for s in per_site) or None,
        "iterations": per_site[0]["iterations"],
        "curve": curve,
    }


def _per_site_progress(per_site: Sequence[dict]) -> dict:
    """Progress of sites that step on their own (the ceiling, a non-lockstep job): each site
    applies its own updates, so the job's updates/s is the mean of the sites' (what a
    lockstep job whose every site kept its pace would show), while tokens add up."""
    updates = sum(s["updates"] for s in per_site) / len(per_site)
    tokens = sum(s["tokens_trained"] for s in per_site)
    return {"updates_per_s": sum(s["updates_per_s"] for s in per_site) / len(per_site), "updates": updates,
            "tokens_trained": tokens, "tokens_per_update": tokens / updates,
            "run_wall_s": max(s["run_wall_s"] for s in per_site)}


def loss_at(curve: Sequence[dict], key: str, x: float) -> Optional[float]:
    """The curve's loss at `x` (wall_s or tokens), linearly interpolated between log
    intervals; None before its first point."""
    points = [(p[key], p["loss"]) for p in curve if p.get("loss") is not None]
    if not points or x < points[0][0]:
        return None
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1
    return points[-1][1]


def time_to_loss(curve: Sequence[dict], target: float) -> Optional[float]:
    """Wall-clock seconds at which a training-loss curve first reaches `target` (linear
    between logged points; None if it never does)."""
    prev = None
    for p in curve:
        if p["loss"] is not None and p["loss"] <= target:
            if prev is None or prev["loss"] is None or prev["loss"] == p["loss"]:
                return p["wall_s"]
            frac = (prev["loss"] - target) / (prev["loss"] - p["loss"])
            return prev["wall_s"] + frac * (p["wall_s"] - prev["wall_s"])
        prev = p
    return None


def build_results(scenario: dict, ceiling: dict, runs: Dict[str, dict]) -> dict:
    """results.json: every algorithm's progress (updates/s) and work (tokens/s), each as a
    ratio to the ceiling of the same run; the wall-clock time at which its training loss
    first reaches sync's final loss, also as a fraction of sync's whole run (when sync ran);
    and its loss at equal wall-clock time: at the moment the first algorithm finished (the
    ceiling, which trains per-site models, is left out of that moment)."""
    out = []
    sync = runs.get("sync", {})
    sync_bytes = sync.get("inter_site_bytes_per_step")
    target = sync.get("loss")
    sync_wall = sync["curve"][-1]["wall_s"] if sync.get("curve") else None
    finished = [m["curve"][-1]["wall_s"] for m in runs.values() if m["curve"]]
    equal_wall = min(finished) if finished else None
    for name, m in [(CEILING, ceiling)] + list(runs.items()):
        reach = time_to_loss(m["curve"], target) if target is not None and name != CEILING else None
        row = {"algorithm": name, **{k: m[k] for k in ("tokens_per_s", "inter_site_bytes_per_step",
                                                       "exposed_comm_s_per_step", "loss", "peak_rss_mb",
                                                       "updates_per_s", "updates", "tokens_trained",
                                                       "tokens_per_update", "run_wall_s")},
               **{k: m[k] for k in ("site_iterations", "site_tokens_per_s") if k in m},
               "ratio_to_ceiling": m["tokens_per_s"] / ceiling["tokens_per_s"],
               "updates_ratio_to_ceiling": m["updates_per_s"] / ceiling["updates_per_s"],
               "bytes_vs_sync": m["inter_site_bytes_per_step"] / sync_bytes if sync_bytes else None,
               "time_to_sync_loss_s": reach,
               "time_to_sync_loss_vs_sync": reach / sync_wall if reach is not None and sync_wall else None,
               "equal_wall_s": equal_wall,
               "loss_at_equal_wall": loss_at(m["curve"], "wall_s", equal_wall) if equal_wall else None,
               "curve": m["curve"]}
        out.append(row)
    return {"scenario": scenario, "runs": out}


def markdown_table(results: dict) -> str:
    """The headline is progress: updates/s against the ceiling, then the time to sync's final
    loss. tokens/s is work done, and follows: an algorithm that grows its batch (adaptive
    accumulation) computes more tokens per update without updating more often."""
    runs = results["runs"]
    wall = next((r.get("equal_wall_s") for r in runs if r.get("equal_wall_s")), None)
    wall_head = f"loss at {wall:.0f} s" if wall else "loss at equal wall-clock"
    lines = ["| algorithm | updates/s | updates/s vs ceiling | time to sync's final loss (x sync's run) | "
             "updates in run | tokens/s | tokens/s vs ceiling | tokens per update | inter-site MB/step | "
             f"vs sync bytes | exposed comm s/step | final loss | {wall_head} | peak RSS MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        vs = f"{r['bytes_vs_sync']:.3f}" if r.get("bytes_vs_sync") is not None else "-"
        loss = f"{r['loss']:.3f}" if r["loss"] is not None else "-"
        if r.get("site_iterations"):  # non-lockstep: each site's own steps
            loss += f" (site steps {'/'.join(map(str, r['site_iterations']))})"
        at_wall = f"{r['loss_at_equal_wall']:.3f}" if r.get("loss_at_equal_wall") is not None else "-"
        rss = f"{r['peak_rss_mb']:.0f}" if r["peak_rss_mb"] else "-"
        reach = r.get("time_to_sync_loss_vs_sync")
        reach = f"{r['time_to_sync_loss_s']:.0f} s ({reach:.2f})" if reach is not None else \
            ("not reached" if r["algorithm"] != CEILING and r.get("time_to_sync_loss_s", 0) is None else "-")
        lines.append(f"| {r['algorithm']} | {r['updates_per_s']:.3f} | **{r['updates_ratio_to_ceiling']:.3f}** | "
                     f"{reach} | {r['updates']:g} in {r['run_wall_s']:.0f} s | {r['tokens_per_s']:.0f} | "
                     f"{r['ratio_to_ceiling']:.3f} | {r['tokens_per_update']:.0f} | "
                     f"{r['inter_site_bytes_per_step'] / 2**20:.2f} | {vs} | {r['exposed_comm_s_per_step']:.3f} | "
                     f"{loss} | {at_wall} | {rss} |")
    return "\n".join(lines) + "\n"


COLUMN_NOTES = """\
- updates/s: optimizer steps per second, the log's first interval left out (a non-lockstep
  job: the mean of its sites' own rates). Its ratio to the ceiling is the headline: how
  often the model moves, against every site training alone.
- time to sync's final loss: wall-clock seconds until the training loss first reaches the
  loss `sync` ended with (interpolated between log intervals), and that time over sync's run.
- updates in run: optimizer steps, and the run's wall-clock seconds from start to its last
  update applied.
- tokens/s, tokens/s vs ceiling: work done, not progress. An algorithm that adds
  micro-batches while it waits (acco/dpu adaptive accumulation) raises its tokens per
  update and its tokens/s while its updates/s falls.
- tokens per update: tokens of all sites per optimizer step (a non-lockstep job: per mean
  site step); runs with different values did not train on equal tokens.
"""


def plot(results: dict, out_dir: str, title: Optional[str] = None) -> List[str]:
    """updates_per_s.png and tokens_per_s.png (bars, ceiling dashed), loss_vs_wall.png,
    loss_vs_tokens.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    title = title or scenario_title(results["scenario"])
    paths = []

    algos = [r for r in runs if r["algorithm"] != CEILING]
    ceiling = next(r for r in runs if r["algorithm"] == CEILING)
    for key, ratio, ylabel in (("updates_per_s", "updates_ratio_to_ceiling", "updates/s (progress)"),
                               ("tokens_per_s", "ratio_to_ceiling", "tokens/s (work, not progress)")):
        fig, ax = plt.subplots(figsize=(6, 3.8))
        bars = ax.bar([r["algorithm"] for r in algos], [r[key] for r in algos], color="tab:blue")
        for bar, r in zip(bars, algos):
            ax.annotate(f"{r[ratio]:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom")
        ax.axhline(ceiling[key], color="black", linestyle="--", label="ceiling (sites alone)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, 1.2 * max([ceiling[key]] + [r[key] for r in algos]))
        plt.setp(ax.get_xticklabels(), rotation=30, ha="right")  # ten names must not overlap
        ax.set_title(title, fontsize=9)
        ax.legend(loc="upper right")
        paths.append(_save(fig, out_dir, f"{key}.png"))

    for key, xlabel, name in (("wall_s", "wall-clock (s)", "loss_vs_wall.png"),
                              ("tokens", "tokens (all sites)", "loss_vs_tokens.png")):
        fig, ax = plt.subplots(figsize=(6, 3.8))
        for r in runs:
            style = "--" if r["algorithm"] == CEILING else "-"
            label = "ceiling (per-site models, mean)" if r["algorithm"] == CEILING else r["algorithm"]
            ax.plot([p[key] for p in r["curve"]], [p["loss"] for p in r["curve"]], style, marker=".", label=label)
        sync = next((r for r in runs if r["algorithm"] == "sync"), None)
        if key == "wall_s" and sync is not None and sync["loss"] is not None:
            ax.axhline(sync["loss"], color="gray", linestyle=":", linewidth=1, label="sync's final loss")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("training loss")
        ax.set_title(title, fontsize=9)
        ax.legend()
        paths.append(_save(fig, out_dir, name))
    return paths


def _save(fig, out_dir: str, name: str) -> str:
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def scenario_title(s: dict) -> str:
    text = (f"{s['sites']} sites x {s['ranks_per_site']} ranks, {s['rate_mbit']:g} Mbit/s, "
            f"{s['delay_ms']:g} ms one-way")
    if s.get("straggler"):
        st = s["straggler"]
        text += f", rank(s) {st['ranks']} {st['factor']:g}x slower ({st['mode']})"
    return text


def write_all(results: dict, out_dir: str) -> List[str]:
    """results.md and the plots into `out_dir`, results.json beside the logs (results_path)."""
    os.makedirs(out_dir, exist_ok=True)
    raw = os.path.join(results_path(out_dir), "results.json")
    os.makedirs(os.path.dirname(os.path.abspath(raw)), exist_ok=True)
    write_json(raw, results, indent=1)
    table = markdown_table(results)
    write_text(os.path.join(out_dir, "results.md"), f"{scenario_title(results['scenario'])}\n\n{table}\n{COLUMN_NOTES}")
    return [raw, os.path.join(out_dir, "results.md")] + plot(results, out_dir)


def report_from_logs(out_dir: str, warmup_intervals: int = 1) -> dict:
    """Rebuild a wan_bench run's results from what it left in `out_dir`: the scenario and the
    run labels from results.json, every figure from logs/ (so an older run gains the
    figures added since, from the same measurements). For an `out_dir` in docs/ they are read
    from its place under results/ (results_path)."""
    data = results_path(out_dir)
    old = read_json_object(os.path.join(data, "results.json"), "wan_bench results",
                           "run wan_bench again to write it")
    logs = os.path.join(data, "logs")
    sites = old["scenario"]["sites"]
    ceiling = combine_ceiling([summarize(read_log(os.path.join(logs, f"{CEILING}.site{i}.jsonl")), warmup_intervals)
                               for i in range(sites)])
    labels = [r["algorithm"] for r in old["runs"] if r["algorithm"] != CEILING]
    runs = {label: summarize(read_log(os.path.join(logs, f"{label}.jsonl")), warmup_intervals) for label in labels}
    return build_results(old["scenario"], ceiling, runs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Re-report a wan_bench run from its logs: rewrites results.json, "
                                            "results.md and the plots in OUT_DIR (the runs are not repeated).")
    p.add_argument("out_dir", help="a wan_bench --out-dir holding results.json and logs/ (for one in docs/: "
                                   "under results/, same path)")
    p.add_argument("--warmup-intervals", type=int, default=1, help="log intervals left out of the rates")
    a = p.parse_args(argv)
    if a.warmup_intervals < 0:
        p.error("--warmup-intervals must be 0 or more")
    try:
        results = report_from_logs(a.out_dir, a.warmup_intervals)
    except ToolInputError as err:  # a damaged file: the message names it
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (OSError, KeyError, TypeError, ValueError) as err:  # a missing file, an older or foreign layout
        print(f"error: {a.out_dir}: not a wan_bench output directory this script can read ({err!r})",
              file=sys.stderr)
        return 2
    try:
        paths = write_all(results, a.out_dir)
    except WriteError as err:  # a full disk: the message names the file; earlier files are kept
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(markdown_table(results))
    print("wrote " + ", ".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
