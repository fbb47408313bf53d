"""DreamDDP's scheduler against brute force on random profiles (no processes, seconds).

    python -m tools.bench parts dreamddp --out-dir docs/algorithms/results/dreamddp

For every random profile (L units, H iterations per period, backward times, averaging
times from a latency + size x slope link whose speed relative to compute ranges from
"everything hides" to "nothing does", with or without a tail) it computes:

- the DFS schedule (the paper's three pruning rules) and the brute-force optimum over
  every contiguous assignment: exposed-time ratio and search-tree nodes of each;
- the equal-number partition (the paper's PLSGD-ENP baseline): its ratio to the optimum;
- for L <= 8, the optimum over *all* assignments (not only contiguous blocks, H^L): how
  much restricting the search to contiguous blocks costs;
- bubble filling: how many extra unit averages per period it adds for free.

Writes scheduler.md and scheduler.png to --out-dir, and scheduler.json, the raw summary, to the
same path under results/ when --out-dir is in docs/ (results/algorithms/results/dreamddp for
the default), else to --out-dir too.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from megatron_lsgd.core.lsgd.algorithms.dreamddp.scheduler import (Problem, brute_force_schedule, dfs_schedule,  # noqa: E402
                                                        equal_number_schedule, fill_bubbles, unrestricted_optimum)
from megatron_lsgd.core.output_files import save_figure, write_json, write_text  # noqa: E402
from tools.benchmarks.run_cache import results_path  # noqa: E402
from tools.benchmarks.tool_input import tool_errors  # noqa: E402

TOL = 1e-12  # seconds: "equal" and "zero" exposed times


def random_problem(rng: random.Random, num_units: int) -> Problem:
    """Backward times of layers; averaging times from a latency + size x slope link whose
    speed relative to compute ranges from "everything hides" to "nothing does"."""
    backward = [rng.uniform(0.2, 2.0) for _ in range(num_units)]
    sizes = [rng.choice([0.1, 0.5, 1.0, 1.0, 1.0, 3.0]) for _ in range(num_units)]
    ratio = rng.choice([0.05, 0.2, 0.5, 1.0, 2.0, 5.0])  # link time of a 1.0-size unit / mean backward
    latency = rng.choice([0.0, 0.05, 0.3])
    mean_b = sum(backward) / num_units
    comm = [latency + s * ratio * mean_b for s in sizes]
    tail = rng.choice([0.0, 0.0, 0.5 * mean_b])
    return Problem(tuple(backward), tuple(comm), tail)


def ratio(x: float, best: float) -> float:
    """x / best; 1 when both are zero, inf when only the optimum hides everything."""
    if best <= TOL:
        return 1.0 if x <= TOL else float("inf")
    return x / best


def run(cases: int, seed: int, max_units: int, max_slots: int, unrestricted_max_units: int) -> Dict:
    rng = random.Random(seed)
    rows: List[Dict] = []
    t_dfs = t_brute = 0.0
    for _ in range(cases):
        L, H = rng.randint(2, max_units), rng.randint(1, max_slots)
        p = random_problem(rng, L)
        t0 = time.perf_counter()
        dfs = dfs_schedule(p, H)
        t1 = time.perf_counter()
        brute = brute_force_schedule(p, H)
        t2 = time.perf_counter()
        t_dfs, t_brute = t_dfs + t1 - t0, t_brute + t2 - t1
        enp = equal_number_schedule(p, H)
        filled = fill_bubbles(p, dfs.slots)
        row = {"L": L, "H": H, "dfs": dfs.exposed, "optimum": brute.exposed, "enp": enp.exposed,
               "dfs_nodes": dfs.nodes, "brute_nodes": brute.nodes,
               "extra_averages": sum(len(s) for s in filled) - L, "rules": dfs.stats}
        if L <= unrestricted_max_units and H > 1:
            row["unrestricted"] = unrestricted_optimum(p, H).exposed
        rows.append(row)
    return {"rows": rows, "seconds_dfs": t_dfs, "seconds_brute": t_brute}


def summarize(result: Dict) -> Dict:
    rows = result["rows"]
    r_dfs = [ratio(r["dfs"], r["optimum"]) for r in rows]
    r_enp = [ratio(r["enp"], r["optimum"]) for r in rows]
    un = [r for r in rows if "unrestricted" in r]
    r_un = [ratio(r["optimum"], r["unrestricted"]) for r in un]

    def dist(xs: List[float]) -> Dict:
        finite = sorted(x for x in xs if x != float("inf"))
        return {"equal_share": sum(1 for x in xs if x <= 1 + 1e-9) / len(xs),
                "mean": statistics.fmean(finite), "p50": finite[len(finite) // 2],
                "p90": finite[int(0.9 * (len(finite) - 1))], "p99": finite[int(0.99 * (len(finite) - 1))],
                "max": finite[-1], "exposed_where_optimum_hides": sum(1 for x in xs if x == float("inf")) / len(xs)}

    nodes_d = sum(r["dfs_nodes"] for r in rows)
    nodes_b = sum(r["brute_nodes"] for r in rows)
    by_l = {}
    for r in rows:
        by_l.setdefault(r["L"], []).append(r["dfs_nodes"] / r["brute_nodes"])
    rules = {k: sum(r["rules"][k] for r in rows) for k in rows[0]["rules"]}
    return {"cases": len(rows), "dfs_vs_optimum": dist(r_dfs), "enp_vs_optimum": dist(r_enp),
            "contiguous_vs_unrestricted": dist(r_un) if r_un else None, "unrestricted_cases": len(un),
            "nodes_dfs": nodes_d, "nodes_brute": nodes_b, "nodes_ratio": nodes_d / nodes_b,
            "nodes_ratio_median_by_L": {L: statistics.median(v) for L, v in sorted(by_l.items())},
            "rules_fired": rules, "seconds_dfs": result["seconds_dfs"], "seconds_brute": result["seconds_brute"],
            "extra_averages_mean": statistics.fmean(r["extra_averages"] for r in rows),
            "cases_with_extra_averages": sum(1 for r in rows if r["extra_averages"] > 0) / len(rows)}


def markdown(s: Dict, args) -> str:
    def row(name, d):
        return (f"| {name} | {100 * d['equal_share']:.1f}% | {100 * d['exposed_where_optimum_hides']:.1f}% | "
                f"{d['mean']:.4f} | {d['p50']:.3f} | {d['p90']:.3f} | {d['p99']:.3f} | {d['max']:.3f} |")

    lines = [f"{s['cases']} random profiles, L = 2..{args.max_units} units, H = 1..{args.max_slots}, seed {args.seed} "
             f"(`python -m tools.bench parts dreamddp --cases {args.cases} --seed {args.seed}`).", "",
             "Exposed time per period compared with the optimum over contiguous assignments (brute force). "
             "Ratios are over the cases where something must be exposed; the third column counts the cases "
             "where the optimum hides everything and the schedule does not (its ratio would be infinite):", "",
             "| schedule | equal to the optimum | exposes where the optimum hides all | mean ratio | median | "
             "p90 | p99 | max |", "|---|---|---|---|---|---|---|---|",
             row("DFS with the three pruning rules", s["dfs_vs_optimum"]),
             row("equal-number partition (PLSGD-ENP)", s["enp_vs_optimum"])]
    if s["contiguous_vs_unrestricted"]:
        lines.append(row(f"contiguous optimum vs any assignment (H^L, {s['unrestricted_cases']} cases with "
                         f"L <= {args.unrestricted_max_units}, H >= 2)", s["contiguous_vs_unrestricted"]))
    lines += ["", f"Search-tree nodes: DFS {s['nodes_dfs']:,} vs brute force {s['nodes_brute']:,} "
                  f"(**{100 * s['nodes_ratio']:.2f}%**); median DFS/brute-force ratio by L: "
                  + ", ".join(f"L={L}: {100 * v:.1f}%" for L, v in s["nodes_ratio_median_by_L"].items()) + ".",
              f"Time: DFS {s['seconds_dfs']:.2f} s, brute force {s['seconds_brute']:.2f} s in total.",
              "Pruning rules applied (times): " + ", ".join(f"{k.replace('_', ' ')} {v:,}"
                                                            for k, v in s["rules_fired"].items()) + ".",
              f"Bubble filling added unit averages in {100 * s['cases_with_extra_averages']:.0f}% of the cases, "
              f"{s['extra_averages_mean']:.2f} per period on average, without adding exposed time."]
    return "\n".join(lines) + "\n"


def plot(result: Dict, s: Dict, out_dir: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    Ls = sorted({r["L"] for r in rows})
    for key, label in (("brute_nodes", "brute force (every contiguous assignment)"), ("dfs_nodes", "DFS, pruned")):
        a.plot(Ls, [statistics.median(r[key] for r in rows if r["L"] == L) for L in Ls], marker="o", label=label)
    a.set_yscale("log")
    a.set_xlabel("units L (median over H = 1..5)")
    a.set_ylabel("search-tree nodes visited")
    a.legend(fontsize=8)
    a.set_title("nodes visited", fontsize=9)
    curves = [("DFS / optimum", [ratio(r["dfs"], r["optimum"]) for r in rows]),
              ("equal-number / optimum", [ratio(r["enp"], r["optimum"]) for r in rows])]
    un = [ratio(r["optimum"], r["unrestricted"]) for r in rows if "unrestricted" in r]
    if un:
        curves.append(("contiguous optimum / any assignment (L<=8)", un))
    for label, xs in curves:
        xs = sorted(min(x, 1e3) for x in xs)  # "exposes where the optimum hides" drawn at 1000
        b.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
    b.set_xlim(0.98, 3.0)
    b.set_xlabel("exposed time per period / optimum (cut at 3)")
    b.set_ylabel("share of profiles (CDF)")
    b.legend(fontsize=8)
    b.set_title(f"{s['cases']} random profiles", fontsize=9)
    fig.tight_layout()
    path = os.path.join(out_dir, "scheduler.png")
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=2000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-units", type=int, default=12)
    p.add_argument("--max-slots", type=int, default=5)
    p.add_argument("--unrestricted-max-units", type=int, default=8)
    p.add_argument("--out-dir", default="docs/algorithms/results/dreamddp",
                   help="the table and its PNG; scheduler.json under results/ when this is in docs/")
    args = p.parse_args(argv)
    result = run(args.cases, args.seed, args.max_units, args.max_slots, args.unrestricted_max_units)
    s = summarize(result)
    os.makedirs(args.out_dir, exist_ok=True)
    raw = os.path.join(results_path(args.out_dir), "scheduler.json")  # measured data: under results/
    os.makedirs(os.path.dirname(os.path.abspath(raw)), exist_ok=True)
    write_json(raw, {"summary": s, "args": vars(args)}, indent=1)
    print("wrote", raw)
    text = markdown(s, args)
    write_text(os.path.join(args.out_dir, "scheduler.md"), text)
    print(text)
    try:
        print("wrote", plot(result, s, args.out_dir))
    except ImportError:
        print("matplotlib not installed: no PNG written")
    return 0


if __name__ == "__main__":
    with tool_errors():
        sys.exit(main())
