"""Chaos run for elastic sites (--lsgd-fault-tolerance torchft): kill a random site every N
seconds, restart it at once (as torchrun --max-restarts would), and report what survived.

    python tools/benchmarks/chaos.py --sites 3 --min-sites 2 --fault-every 10 --steps 400

Each site is tools/benchmarks/ft_site.py (the real diloco synchronizer, TorchftMembership,
torchft's Manager, lighthouse and checkpoint transport on loopback; a toy inner step), one
process per site, killed with SIGKILL. The same job runs first without faults (the
baseline for goodput). Reported (and written to --out-dir/chaos.json):
- faults injected (only a site whose process is training is killed, at most --max-down sites
  down at once; none after the first site finished), and survived (the job reached its
  budget with at least --min-sites sites, every one of them exiting 0), how many killed
  sites rejoined (healed from a peer), and which were still restarting when the job ended
  (stopped after --timeout + 10 s: they wait for a quorum that cannot come);
- rounds committed vs attempted (the survivors' counts);
- goodput: useful inner steps (committed rounds x H) / the inner steps the fault-free run
  takes in the same wall time;
- time to rejoin: from the kill to the restarted site's "rejoined" line;
- digests: SHA-256 of anchor + outer momentum of every site at every committed round; all
  sites must agree at every round.
The toy model has no validation loss; the final anchor is compared with the fault-free
run's instead (they differ by design: lost rounds and healed sites change the numbers).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from typing import Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse runs in this process

from tools.benchmarks.ft_site import SiteSpec, launch, read_log, start_lighthouse, starts, wait_started  # noqa: E402


def training(records: List[Dict], earlier: int) -> bool:
    """Whether the site's current process (after `earlier` earlier ones) has joined the job:
    it committed a round or was healed. Only such a site is killed, so each fault hits a
    site that is really training (a restart on a loaded machine can take tens of seconds)."""
    begun = starts(records)
    if len(begun) <= earlier:
        return False
    return any("round" in r or "rejoined" in r.get("log", "") for r in records[begun[earlier]:])


def run_job(args, out_dir: str, faults: bool, log=print) -> Dict:
    os.makedirs(out_dir, exist_ok=True)
    lh = start_lighthouse(args.min_sites)
    go = os.path.join(out_dir, "go")
    rng = random.Random(args.seed)

    def spec(site: int) -> SiteSpec:
        return SiteSpec(site=site, num_sites=args.sites, steps=args.steps, interval=args.interval, out_dir=out_dir,
                        lighthouse=lh.address(), min_sites=args.min_sites, compression=args.compression,
                        step_seconds=args.step_seconds, timeout_s=args.timeout, go_file=go)

    kills: List[Dict] = []
    late: List[int] = []  # sites still waiting when the others had finished the job
    procs = {}
    try:
        procs.update({s: launch(spec(s)) for s in range(args.sites)})
        wait_started(out_dir, procs)
        open(go, "w").close()
        t0 = time.time()
        next_fault = t0 + args.fault_every
        started = {s: 0 for s in procs}  # processes of each site that started before its current one
        ended_at = None  # when the first site finished the job (its budget of steps, exit 0)
        while [p.poll() for p in list(procs.values())].count(None):
            now = time.time()
            if ended_at is None and 0 in [p.returncode for p in procs.values()]:
                ended_at = now
            if ended_at is not None and now - ended_at > args.timeout + 10:
                # A site restarted too late for the job's last quorum waits for peers that
                # have finished (docs/fault_tolerance.md, "What is missing"): stop it.
                for s, p in procs.items():
                    if p.poll() is None:
                        p.kill()
                        late.append(s)
                break
            if now - t0 > args.max_minutes * 60:
                raise RuntimeError(f"the job did not end in --max-minutes {args.max_minutes} ({out_dir})")
            up = [s for s, p in procs.items() if p.poll() is None and training(read_log(out_dir, s), started[s])]
            if faults and ended_at is None and now >= next_fault and args.sites - len(up) < args.max_down:
                victim = rng.choice(up)
                started[victim] += 1  # its next process counts as up once it has started
                procs[victim].kill()  # SIGKILL: no clean-up, no goodbye
                procs[victim].wait()
                procs[victim] = launch(spec(victim))
                kills.append({"site": victim, "t": now, "starts_before": started[victim] - 1})
                log(f"[chaos] {now - t0:6.1f} s: killed site {victim}, restarted it")
                next_fault = now + args.fault_every
            time.sleep(0.05)
        wall = (ended_at or time.time()) - t0
        codes = {s: p.returncode for s, p in procs.items()}
    finally:
        for p in procs.values():  # nothing left behind when the run fails
            if p.poll() is None:
                p.kill()
        lh.shutdown()
    records = {s: read_log(out_dir, s) for s in range(args.sites)}
    return {"wall_s": wall, "codes": codes, "kills": kills, "records": records, "late": late}


def summarize(args, base: Dict, chaos: Dict) -> Dict:
    records = chaos["records"]
    # digests: every site's record of every committed round (a restarted site's killed process included)
    by_round: Dict[int, set] = {}
    for recs in records.values():
        for r in recs:
            if "round" in r:
                by_round.setdefault(r["round"], set()).add(r["digest"])
    disagree = sorted(k for k, d in by_round.items() if len(d) > 1)
    # rejoin times and survived faults
    rejoined, rejoin = 0, []
    for kill in chaos["kills"]:
        recs = records[kill["site"]]
        begun = starts(recs)
        if len(begun) <= kill["starts_before"] + 1:
            continue  # the restarted process never got going
        after = recs[begun[kill["starts_before"] + 1]:]
        healed = [r for r in after if "rejoined" in r.get("log", "")]
        if healed:
            rejoined += 1
            rejoin.append(healed[0]["t"] - kill["t"])
    finals = [[r for r in recs if "round" in r] for recs in records.values()]
    committed = max(r[-1]["round"] for r in finals if r)
    never_killed = [s for s in records if s not in {k["site"] for k in chaos["kills"]}]
    attempted = max((r[-1]["attempted"] for s, r in zip(records, finals) if r and s in never_killed), default=None)
    useful = committed * args.interval
    base_rate = args.steps / base["wall_s"]  # inner steps per second without faults
    goodput = useful / (base_rate * chaos["wall_s"])
    finished = [s for s, c in chaos["codes"].items() if c == 0]
    # The job survived when the sites that finished reached the budget with the same state
    # and at least --min-sites of them did; no committed round was lost.
    killed = {k["site"] for k in chaos["kills"]}
    all_ok = len(finished) >= args.min_sites and set(chaos["late"]) <= killed and \
        all(c == 0 for s, c in chaos["codes"].items() if s not in chaos["late"])
    base_final = [r for r in base["records"][0] if "round" in r][-1]
    return {
        "sites": args.sites, "min_sites": args.min_sites, "interval": args.interval, "steps": args.steps,
        "fault_every_s": args.fault_every, "wall_s": round(chaos["wall_s"], 1), "baseline_wall_s": round(base["wall_s"], 1),
        "faults_injected": len(chaos["kills"]), "faults_survived": len(chaos["kills"]) if all_ok else 0,
        "killed_sites_rejoined": rejoined, "sites_restarted_after_the_end": chaos["late"],
        "sites_finished": finished, "job_finished": all_ok, "rounds_committed": committed, "rounds_attempted_by_unkilled_site": attempted,
        "baseline_rounds": base_final["round"], "goodput": round(goodput, 3),
        "rejoin_s": {"mean": round(sum(rejoin) / len(rejoin), 2), "max": round(max(rejoin), 2)} if rejoin else None,
        "digest_rounds_checked": len(by_round), "digest_disagreements": disagree,
        "final_anchor_max_abs_diff_vs_baseline": max(
            abs(a - b) for a, b in zip(finals[finished[0]][-1]["anchor"], base_final["anchor"])) if finished else None,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sites", type=int, default=3)
    p.add_argument("--min-sites", type=int, default=2)
    p.add_argument("--interval", type=int, default=4, help="H")
    p.add_argument("--steps", type=int, default=400, help="inner steps of the job (every site)")
    p.add_argument("--step-seconds", type=float, default=0.05, help="sleep per toy inner step")
    p.add_argument("--fault-every", type=float, default=10.0, help="seconds between SIGKILLs")
    p.add_argument("--max-down", type=int, default=0,
                   help="most sites down at once (default: --sites minus --min-sites, so the floor is never hit)")
    p.add_argument("--compression", default="none", choices=("none", "int8", "int4"))
    p.add_argument("--timeout", type=float, default=5.0, help="--lsgd-ft-timeout of the sites")
    p.add_argument("--max-minutes", type=float, default=5.0, help="give up (and fail) after this long")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="")
    args = p.parse_args(argv)
    if args.sites < 2 or not 1 <= args.min_sites <= args.sites:
        print("error: --sites must be >= 2 and --min-sites in [1, --sites]", file=sys.stderr)
        return 2
    if args.min_sites == args.sites:
        print("error: --min-sites equal to --sites leaves no site to lose: every fault pauses the job", file=sys.stderr)
        return 2
    args.max_down = args.max_down or args.sites - args.min_sites
    out = args.out_dir or tempfile.mkdtemp(prefix="chaos-")
    base = run_job(args, os.path.join(out, "baseline"), faults=False)
    if set(base["codes"].values()) != {0}:
        print(f"error: the fault-free baseline failed (exit codes {base['codes']}; see {out}/baseline)", file=sys.stderr)
        return 1
    print(f"[chaos] baseline: {args.steps} steps in {base['wall_s']:.1f} s")
    chaos = run_job(args, os.path.join(out, "chaos"), faults=True)
    summary = summarize(args, base, chaos)
    with open(os.path.join(out, "chaos.json"), "w") as f:
        json.dump(summary, f, indent=1)
    for key, value in summary.items():
        print(f"{key}: {value}")
    ok = summary["job_finished"] and not summary["digest_disagreements"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
