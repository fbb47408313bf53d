"""Chaos run for elastic sites (--lsgd-fault-tolerance torchft): kill a random site every N
seconds, restart it at once, and report what survived. The same job runs first without
faults (the baseline for goodput and for the final validation loss), unless
--baseline-from names an earlier run of the same job.

    # pretrain_gpt.py sites (the default): each site a torchrun job of its own, a lighthouse
    # in this process; pretrain_gpt.py's flags after `--` (default: a small mock-data job)
    python -m tools.bench chaos --sites 3 --min-sites 2 --fault-every 120 --max-minutes 150 -- \\
        --num-layers 4 ... --train-iters 20000 --lsgd-algorithm diloco --lsgd-interval 50
    # the toy site (tools/benchmarks/elastic/ft_site.py: the real diloco synchronizer, a toy inner step)
    python -m tools.bench chaos --target toy --sites 3 --min-sites 2 --steps 400 --fault-every 10

A fault (`--faults`, the kinds taken in turn) is a SIGKILL of every process of a random
site (`site`: its torchrun and ranks; the tool starts the site again at once, from its
checkpoint when the job saves, else fresh), of one rank (`rank`: torchrun's --max-restarts
restarts the site's ranks), a site frozen with SIGSTOP for --freeze-s (`freeze`: past
--timeout, so the others go on without it; SIGCONT then lets it find out and rejoin), or
its link cut for --cut-s (`cut`: its `wan0` down, with --wan-rate-mbit). Only a site that
is training (it logged a step or was healed since it last started, and a frozen or cut
site also --timeout after it is back) is hit, at most --max-down sites at once (default:
--sites minus --min-sites, so the floor is never hit), none after the first site
finished. With --wan-rate-mbit the sites run in the emulated WAN (tools/wan: a network
namespace per site, a shaped link of that rate and --wan-delay-ms between them) and the
lighthouse on a host of its own on it (one namespace more), so no site's fault takes it
down; pretrain target only. Reported (and written to --out-dir/chaos.json):
- faults injected (and by kind), and survived (the job reached its budget with at least
  --min-sites sites, none of them exiting with an error, and every site's digests agree);
- killed sites that rejoined (healed from a peer), and the time from the kill to the
  restarted site's `rejoined` line;
- rounds committed vs attempted (torchft rounds: an outer round, or a fragment sync);
- goodput: (rounds committed / rounds attempted) x (the fault-free run's wall time / this
  run's): the share of the fault-free pace that became kept progress;
- the final validation loss against the fault-free run's (pretrain);
- digests: SHA-256 of every rank's anchor and outer momentum at every committed round
  (--lsgd-ft-digests), compared across sites rank by rank; all must agree;
- heals per fault (one is the killed site's own); for the toy, per fault until the next:
  survivors healed, a survivor with two rounds not committed, and whether the restarted
  site's first quorum held every site; and --out-dir/timeline.txt, every site's quorums
  (id, sites, heal) and rounds not committed around the kills, in time order.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse runs in this process

from megatron_lsgd.training.initialize import free_port  # noqa: E402
from megatron_lsgd.core.output_files import write_json, write_text  # noqa: E402
from tools.benchmarks.elastic.ft_site import SiteSpec, launch, read_log, start_lighthouse, starts, wait_started  # noqa: E402
from tools.benchmarks.process_tree import descendants, kill_tree, sigkill  # noqa: E402
from tools.benchmarks.tool_input import read_json_object, tool_errors  # noqa: E402

FAULT_KINDS = ("site", "rank", "freeze", "cut")
LIGHTHOUSE_PORT = 29510


# ---- the toy site (ft_site.py) -------------------------------------------------------------------
def training(records: List[Dict], earlier: int) -> bool:
    """Whether the site's current process (after `earlier` earlier ones) has joined the job:
    it committed a round or was healed. Only such a site is killed, so each fault hits a
    site that is really training (a restart on a loaded machine can take tens of seconds)."""
    begun = starts(records)
    if len(begun) <= earlier:
        return False
    return any("round" in r or "rejoined" in r.get("log", "") for r in records[begun[earlier]:])


def run_toy_job(args, out_dir: str, faults: bool, log=print) -> Dict:
    os.makedirs(out_dir, exist_ok=True)
    lh = start_lighthouse(args.min_sites, heartbeat_timeout_ms=args.heartbeat_ms, join_timeout_ms=args.join_ms)
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


def fault_costs(records: Dict[int, List[Dict]], kills: List[Dict], sites: int) -> Dict:
    """What each fault cost the sites that were not killed, from the sites' logs: for each kill,
    until the next one, the survivors' heals (a quorum that healed a site which had already
    been in one since it started) and their rounds not committed (`was not committed`
    lines); and whether the restarted site's first quorum held every site (ft_site's quorum
    records). One heal per fault is the killed site's own, at its first quorum."""
    heals = sum("rejoined at committed round" in r.get("log", "") for recs in records.values() for r in recs)
    survivor_healed: Dict[int, List[float]] = {}  # site -> when it was healed after taking part
    for s, recs in records.items():
        joined = False
        for r in recs:
            if r.get("log", "").startswith('{"started"'):
                joined = False
            elif r.get("ft") == "quorum":
                if r["healed"] and joined:
                    survivor_healed.setdefault(s, []).append(r["t"])
                joined = True
    per_fault = []
    for i, kill in enumerate(kills):
        end = kills[i + 1]["t"] if i + 1 < len(kills) else float("inf")
        survivor_heals = not_committed = 0
        learned: Dict[int, float] = {}  # survivor -> when its round failed
        for s, recs in records.items():
            if s == kill["site"]:
                continue
            window = [r.get("log", "") for r in recs if kill["t"] <= r.get("t", 0) < end]
            survivor_heals += sum(kill["t"] <= t < end for t in survivor_healed.get(s, []))
            not_committed = max(not_committed, sum("was not committed" in line for line in window))
            failed = [r["t"] for r in recs if r.get("ft") == "not_committed" and kill["t"] <= r["t"] < end]
            if failed:
                learned[s] = failed[0]
        recs = records[kill["site"]]
        begun = starts(recs)
        after = recs[begun[kill["starts_before"] + 1]:] if len(begun) > kill["starts_before"] + 1 else []
        first = next((r for r in after if r.get("ft") == "quorum"), None)
        per_fault.append({"site": kill["site"], "survivor_heals": survivor_heals,
                          "survivor_rounds_not_committed": not_committed,
                          "first_quorum_sites": first["sites"] if first else None,
                          "learned_apart_s": max(learned.values()) - min(learned.values())
                          if len(learned) == sites - 1 else None})
    joined = [f for f in per_fault if f["first_quorum_sites"] is not None]
    apart = sorted(f["learned_apart_s"] for f in per_fault if f["learned_apart_s"] is not None)
    return {"heals": heals, "heals_per_fault": round(heals / len(kills), 2) if kills else None,
            "survivor_heals": sum(f["survivor_heals"] for f in per_fault),
            "faults_with_a_survivor_healed": sum(f["survivor_heals"] > 0 for f in per_fault),
            "faults_with_a_survivor_two_rounds_not_committed":
                sum(f["survivor_rounds_not_committed"] > 1 for f in per_fault),
            "restarted_first_quorum_held_every_site": f"{sum(len(f['first_quorum_sites']) == sites for f in joined)}"
                                                      f" of {len(joined)}",
            # between the first and the last survivor whose round failed (each fault with every survivor's)
            "survivors_failed_apart_s": {"median": round(apart[len(apart) // 2], 3), "max": round(apart[-1], 3),
                                         "over_1s": sum(a > 1.0 for a in apart), "faults": len(apart)}
            if apart else None}


def timeline(records: Dict[int, List[Dict]], kills: List[Dict]) -> List[str]:
    """The kills and every site's starts, rounds not committed, and quorums that differ from
    its previous one (id or sites) or healed it, in time order (one line each)."""
    events = [(k["t"], f"chaos  killed site {k['site']}") for k in kills]
    for s, recs in records.items():
        last = asked = None
        for r in recs:
            what = r.get("ft")
            if what == "quorum_asked":
                asked = r["t"]
            if what == "quorum":
                if (r["id"], r["sites"]) == last and not r["healed"]:
                    continue
                last = (r["id"], r["sites"])
                line = (f"quorum id {r['id']} sites {_ids(r['sites'])} at committed {r['committed']}"
                        f"{' HEALED' if r['healed'] else ''}"
                        + (f" (asked {r['t'] - asked:.2f} s before)" if asked is not None else ""))
            elif what == "not_committed":
                line = f"round {r['attempted']} NOT COMMITTED (sites {_ids(r['sites'])}: {r['why'][:60]})"
            elif r.get("log", "").startswith('{"started"'):
                line, last = "started (its manager is up)", None
            else:
                continue
            events.append((r["t"], f"site{s}  {line}"))
    events.sort(key=lambda e: e[0])
    t0 = events[0][0] if events else 0.0
    return [f"{t - t0:9.3f}  {line}" for t, line in events]


def _ids(sites) -> str:
    return ",".join(map(str, sites))


def summarize_toy(args, base: Dict, chaos: Dict) -> Dict:
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
        **fault_costs(records, chaos["kills"], args.sites),
        "digest_rounds_checked": len(by_round), "digest_disagreements": disagree,
        "final_anchor_max_abs_diff_vs_baseline": max(
            abs(a - b) for a, b in zip(finals[finished[0]][-1]["anchor"], base_final["anchor"])) if finished else None,
    }


# ---- pretrain_gpt.py sites ------------------------------------------------------------------------
DEFAULT_JOB = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
               "--micro-batch-size", "2", "--lr", "1e-3", "--lr-warmup-iters", "10", "--lr-decay-style", "cosine",
               "--min-lr", "1e-4", "--mock-data", "--vocab-size", "512", "--train-iters", "400", "--log-interval", "4",
               "--eval-iters", "4", "--seed", "7", "--distributed-backend", "gloo", "--lsgd-algorithm", "diloco",
               "--lsgd-interval", "4"]
VALIDATION = re.compile(r"validation loss at iteration\s+(\d+) \| lm loss value: ([0-9.E+-]+)")
STEP_LINE = re.compile(r"iteration\s+\d+/")


def _flag(argv: List[str], name: str) -> Optional[str]:
    """The last value given to `name` in a command line, or None."""
    value = None
    for i, a in enumerate(argv[:-1]):
        if a == name:
            value = argv[i + 1]
    return value


class PretrainSite:
    """One site: a torchrun job of --ranks-per-site pretrain_gpt.py ranks, its log appended
    across restarts (`offset`: where the current start's lines begin); in the emulated WAN's
    namespace `wan.site_ns(site)` when `wan` is given."""

    def __init__(self, site: int, argv: List[str], args, log_path: str, wan=None):
        self.site, self.argv, self.args, self.log_path, self.wan = site, argv, args, log_path, wan
        self.proc: Optional[subprocess.Popen] = None
        self.offset = 0
        self.starts = 0
        self.trained = self.rejoined = self.finished = False  # since the current start (the log read so far)
        self._read = 0
        # a freeze or a cut under way: when it ends and what ends it; then --timeout to settle
        self.disturbed_until: Optional[float] = None
        self._restore: Optional[Callable[[], None]] = None
        self.settled_at = 0.0

    def restarted(self, note: str) -> None:
        """The lines from here on are a new start's."""
        with open(self.log_path, "a") as log:
            self.offset = self._read = log.tell()
            log.write(f"[chaos] {note} of site {self.site} at {time.time():.3f}\n")
        self.trained = self.rejoined = self.finished = False
        self.starts += 1

    def poll_log(self) -> None:
        """Read the new lines: has the current start trained a step, or been healed?"""
        with open(self.log_path, "rb") as f:
            f.seek(self._read)
            data = f.read()
        end = data.rfind(b"\n") + 1  # whole lines only
        self._read += end
        text = data[:end].decode(errors="replace")
        self.trained = self.trained or bool(STEP_LINE.search(text))
        self.rejoined = self.rejoined or "rejoined at committed round" in text
        self.finished = self.finished or " done: " in text  # trained its budget: leaving

    def start(self, resume: bool) -> None:
        self.restarted(f"start {self.starts}")
        argv = list(self.argv)
        if not resume and "--load" in argv:  # the first start of a job is fresh
            i = argv.index("--load")
            del argv[i:i + 2]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
               str(self.args.ranks_per_site), "--master-port", str(free_port()), "--max-restarts",
               str(self.args.max_restarts), "pretrain_gpt.py"] + argv + ["--lsgd-site", str(self.site)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, MASTER_ADDR="127.0.0.1")
        if self.wan is not None:  # the other sites reach it at its WAN address, over wan0
            from tools.wan.launch import site_env

            cmd = self.wan.in_site(self.site, cmd + ["--lsgd-ft-host", self.wan.site_ip(self.site)])
            env = site_env(env)
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(self.log_path, "a"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def text(self, since_start: bool = True) -> str:
        with open(self.log_path, errors="replace") as f:
            f.seek(self.offset if since_start else 0)
            return f.read()

    def training(self, now: float) -> bool:
        """It logged a step or was healed since its last start, has not finished, and is not
        frozen or cut off, nor was less than --timeout ago (its first collective after it is
        back fails within that, and it rejoins)."""
        return (self.trained or self.rejoined) and not self.finished and self.disturbed_until is None and \
            now >= self.settled_at

    def signal_tree(self, signum: int) -> None:
        """`signum` to its torchrun and every process below it (SIGSTOP / SIGCONT: a freeze)."""
        for pid in [self.proc.pid] + descendants(self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def disturb(self, kind: str, until: float) -> None:
        """Freeze it (SIGSTOP) or cut its link until `until`; `restore_if_due` ends it."""
        if kind == "freeze":
            self.signal_tree(signal.SIGSTOP)
            self._restore = lambda: self.signal_tree(signal.SIGCONT)
        else:
            self.wan.set_link(self.site, up=False)
            self._restore = lambda: self.wan.set_link(self.site, up=True)
        self.disturbed_until = until

    def restore_if_due(self, now: float, force: bool = False) -> bool:
        """End a freeze or a cut whose time is up (or any, `force`); True when one ended."""
        if self.disturbed_until is None or (now < self.disturbed_until and not force):
            return False
        self._restore()
        self.disturbed_until, self._restore = None, None
        self.settled_at = now + self.args.timeout
        self.restarted("back from a freeze or a cut: the same processes")
        return True

    def kill_site(self) -> None:
        kill_tree(self.proc, timeout_s=60)

    def kill_rank(self, rng: random.Random) -> Optional[int]:
        """SIGKILL one of its rank processes (torchrun's workers); None when none is up."""
        ranks = [pid for pid in descendants(self.proc.pid) if _is_rank(pid)]
        if not ranks:
            return None
        victim = rng.choice(ranks)
        sigkill([victim])
        return victim


def _is_rank(pid: int) -> bool:
    """A pretrain_gpt.py worker (not torchrun itself, nor a data-loader child: their
    command line is the worker's, but their parent is a worker)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
        with open(f"/proc/{pid}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{ppid}/cmdline", "rb") as f:
            parent = f.read()
    except (OSError, IndexError, ValueError):
        return False
    return b"pretrain_gpt.py" in cmd and b"torch.distributed.run" not in cmd and b"torch.distributed.run" in parent


def site_argv(args, job: List[str], out_dir: str, lighthouse: str) -> List[str]:
    """The job's flags for every site: the fault tolerance, per-run checkpoints and digests,
    and a validation at the end (for the final loss) when the job has none."""
    argv = list(job) + ["--num-sites", str(args.sites), "--lsgd-fault-tolerance", "torchft", "--lsgd-lighthouse",
                        lighthouse, "--lsgd-min-sites", str(args.min_sites), "--lsgd-ft-timeout", str(args.timeout),
                        "--lsgd-ft-digests", os.path.join(out_dir, "digests")]
    iters = _flag(argv, "--train-iters")
    if iters is None:
        raise ValueError("the job needs --train-iters (its budget: the same in both runs)")
    if int(_flag(argv, "--eval-iters") or 0) == 0:
        argv += ["--eval-iters", "4"]
    if _flag(argv, "--eval-interval") is None:
        argv += ["--eval-interval", iters]
    if _flag(argv, "--save-interval") is not None:  # a restarted site resumes from its own checkpoint
        argv += ["--save", os.path.join(out_dir, "ckpt"), "--load", os.path.join(out_dir, "ckpt")]
    return argv


def fault_kind(kinds: Sequence[str], index: int) -> str:
    """The index-th fault's kind: the kinds in turn, so that a run holds as many of each."""
    return kinds[index % len(kinds)]


@contextlib.contextmanager
def network(args, out_dir: str) -> Iterator[Tuple[str, object]]:
    """(the lighthouse's address, the emulated WAN or None). Loopback: the lighthouse in this
    process. --wan-rate-mbit: a namespace per site and one more holding torchft's lighthouse,
    a host of its own on the shaped links (a cut or a killed site leaves it up)."""
    if not getattr(args, "wan_rate_mbit", 0):
        from tools.benchmarks.elastic.ft_site import start_lighthouse

        lh = start_lighthouse(args.min_sites, heartbeat_timeout_ms=args.heartbeat_ms, join_timeout_ms=args.join_ms)
        try:
            yield lh.address(), None
        finally:
            lh.shutdown()
        return
    from tools.wan.launch import lighthouse_cmd
    from tools.wan.link import LinkSpec
    from tools.wan.topology import WanTopology

    with WanTopology(args.sites + 1, LinkSpec(args.wan_rate_mbit, args.wan_delay_ms)) as wan:
        cmd = lighthouse_cmd(args.min_sites, LIGHTHOUSE_PORT, args.join_ms, args.heartbeat_ms)
        with open(os.path.join(out_dir, "lighthouse.log"), "a") as log:
            lh = subprocess.Popen(wan.in_site(args.sites, cmd), stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        try:
            time.sleep(1.0)  # it binds at once; a site asks for a quorum only after its start-up
            if lh.poll() is not None:
                raise RuntimeError(f"the lighthouse stopped at once (exit {lh.returncode}; {out_dir}/lighthouse.log)")
            yield f"http://{wan.site_ip(args.sites)}:{LIGHTHOUSE_PORT}", wan
        finally:
            kill_tree(lh, timeout_s=10)


def run_pretrain_job(args, job: List[str], out_dir: str, faults: bool, log=print) -> Dict:
    os.makedirs(out_dir, exist_ok=True)
    with network(args, out_dir) as (lighthouse, wan):
        return _run_pretrain_sites(args, job, out_dir, faults, lighthouse, wan, log)


def _run_pretrain_sites(args, job: List[str], out_dir: str, faults: bool, lighthouse: str, wan, log) -> Dict:
    rng = random.Random(args.seed)
    argv = site_argv(args, job, out_dir, lighthouse)
    sites = {k: PretrainSite(k, argv, args, os.path.join(out_dir, f"site{k}.log"), wan) for k in range(args.sites)}
    kills: List[Dict] = []
    late: List[int] = []
    t0 = time.time()
    try:
        for site in sites.values():
            site.start(resume=False)
        next_fault = t0 + args.fault_every
        ended_at = None
        while any(site.proc.poll() is None for site in sites.values()):
            now = time.time()
            codes = [site.proc.returncode for site in sites.values()]
            if ended_at is None and 0 in codes:
                ended_at = now
            if ended_at is not None and now - ended_at > args.timeout + 60:
                # restarted too late for the job's last quorum and its closing one: nobody left to heal it
                for k, site in sites.items():
                    if site.proc.poll() is None:
                        site.kill_site()
                        late.append(k)
                break
            if now - t0 > args.max_minutes * 60:
                raise RuntimeError(f"the job did not end in --max-minutes {args.max_minutes} ({out_dir})")
            for site in sites.values():
                site.poll_log()
                site.restore_if_due(now)
            for kill in kills:  # a restarted site's first `rejoined` line
                site = sites[kill["site"]]
                if kill.get("rejoined_s") is None and site.starts == kill["start"] + 1 and site.rejoined:
                    kill["rejoined_s"] = now - kill["t"]
            if ended_at is None and any(site.finished for site in sites.values()):
                ended_at = now  # a site trained the job's budget: no more faults; the wall time ends here
            up = [k for k, site in sites.items() if site.proc.poll() is None and site.training(now)]
            if any(site.finished for site in sites.values()):
                ended_at = ended_at or now  # the job's budget is reached: no more faults
            if faults and ended_at is None and now >= next_fault and args.sites - len(up) < args.max_down:
                victim = rng.choice(up)
                site = sites[victim]
                kind = fault_kind(args.faults, len(kills))
                kill = {"site": victim, "t": now, "start": site.starts, "kind": kind}
                if kind == "site":
                    site.kill_site()
                    site.start(resume=True)  # as a launcher with restarts would
                    what = f"killed site {victim}, restarted it"
                elif kind == "rank":
                    kill["pid"] = site.kill_rank(rng)
                    site.restarted("a rank killed: torchrun restarts the ranks")
                    what = f"killed a rank of site {victim}"
                else:
                    seconds = args.freeze_s if kind == "freeze" else args.cut_s
                    site.disturb(kind, now + seconds)
                    what = f"{'froze' if kind == 'freeze' else 'cut the link of'} site {victim} for {seconds:g} s"
                kills.append(kill)
                log(f"[chaos] {now - t0:7.1f} s: {what}")
                next_fault = now + args.fault_every
            time.sleep(0.1)
        wall = (ended_at or time.time()) - t0
        codes = {k: site.proc.returncode for k, site in sites.items()}
    finally:
        for site in sites.values():
            if site.proc is not None and site.proc.poll() is None:
                with contextlib.suppress(Exception):  # a frozen site could not die, a cut one would stay cut
                    site.restore_if_due(time.time(), force=True)
                site.kill_site()
    texts = {k: site.text(since_start=False) for k, site in sites.items()}
    return {"wall_s": wall, "codes": codes, "kills": kills, "late": late, "texts": texts,
            "digests": read_digests(os.path.join(out_dir, "digests"))}


def read_digests(directory: str) -> Dict[str, List[Dict]]:
    """rank file (site<k>_rank<r>.jsonl) -> its records (a killed rank's last line may be cut)."""
    out: Dict[str, List[Dict]] = {}
    if not os.path.isdir(directory):
        return out
    for name in sorted(os.listdir(directory)):
        records = []
        with open(os.path.join(directory, name)) as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    break
        out[name] = records
    return out


def check_digests(digests: Dict[str, List[Dict]]) -> Dict:
    """Every site's digest of the same rank position at the same committed round must agree."""
    by_key: Dict[tuple, List[str]] = {}
    for name, records in digests.items():
        rank = name.split("_", 1)[1]
        for r in records:  # the state at the job's end is compared with the others' at the end
            by_key.setdefault((rank, r["round"], bool(r.get("final"))), []).append(r["digest"])
    compared = {key: d for key, d in by_key.items() if len(d) > 1}  # held by two sites or more
    disagree = sorted(f"{rank} round {n}{' (final)' if final else ''}" for (rank, n, final), d in compared.items()
                      if len(set(d)) > 1)
    return {"rounds_checked": len({n for _, n, _ in compared}), "records_compared": sum(map(len, compared.values())),
            "disagreements": disagree}


def final_validation(texts: Dict[int, str]) -> Optional[float]:
    """The last validation loss any site printed (the mean over the sites of that round)."""
    best = None
    for text in texts.values():
        for it, loss in VALIDATION.findall(text):
            if best is None or int(it) >= best[0]:
                best = (int(it), float(loss))
    return best[1] if best else None


def summarize_pretrain(args, base: Dict, chaos: Dict) -> Dict:
    finals = {}
    for name, records in chaos["digests"].items():
        closing = [r for r in records if r.get("final")]
        if closing:
            finals[name] = closing[-1]
    committed = max((r["round"] for r in finals.values()), default=0)
    attempted = max((r["attempted"] for r in finals.values() if r["round"] == committed), default=0)
    base_finals = [r for recs in base["digests"].values() for r in recs if r.get("final")]
    digests = check_digests(chaos["digests"])
    killed = {k["site"] for k in chaos["kills"]}
    finished = sorted(k for k, c in chaos["codes"].items() if c == 0)
    job_ok = len(finished) >= args.min_sites and set(chaos["late"]) <= killed and \
        all(c == 0 for k, c in chaos["codes"].items() if k not in chaos["late"]) and not digests["disagreements"]
    rejoin = [k["rejoined_s"] for k in chaos["kills"] if k.get("rejoined_s") is not None]
    goodput = (committed / attempted) * (base["wall_s"] / chaos["wall_s"]) if attempted else 0.0
    heals = sum(text.count("rejoined at committed round") for text in chaos["texts"].values())
    base_loss, loss = final_validation(base["texts"]), final_validation(chaos["texts"])
    return {
        "target": "pretrain", "sites": args.sites, "min_sites": args.min_sites, "faults": ",".join(args.faults),
        "network": f"emulated WAN, {args.wan_rate_mbit:g} Mbit/s, {args.wan_delay_ms:g} ms"
        if getattr(args, "wan_rate_mbit", 0) else "loopback",
        "fault_every_s": args.fault_every, "wall_s": round(chaos["wall_s"], 1),
        "baseline_wall_s": round(base["wall_s"], 1),
        "faults_injected": len(chaos["kills"]), "faults_survived": len(chaos["kills"]) if job_ok else 0,
        "faults_by_kind": dict(Counter(k.get("kind", "site") for k in chaos["kills"])),
        "killed_sites_rejoined": len(rejoin), "sites_restarted_after_the_end": chaos["late"],
        "sites_finished": finished, "job_finished": job_ok,
        "rounds_committed": committed, "rounds_attempted": attempted,
        "baseline_rounds": max((r["round"] for r in base_finals), default=0),
        "goodput": round(goodput, 3),
        "rejoin_s": {"mean": round(sum(rejoin) / len(rejoin), 2), "max": round(max(rejoin), 2)} if rejoin else None,
        "heals": heals, "heals_per_fault": round(heals / len(chaos["kills"]), 2) if chaos["kills"] else None,
        "final_validation_loss": loss, "baseline_final_validation_loss": base_loss,
        "digest_rounds_checked": digests["rounds_checked"], "digest_records_compared": digests["records_compared"],
        "digest_disagreements": digests["disagreements"],
    }


# ---- the fault-free run, kept for later runs -----------------------------------------------------------
def job_setup(args, job: List[str]) -> Dict:
    """What makes two runs the same job (the fault schedule and its seed do not)."""
    setup = {"target": args.target, "sites": args.sites, "min_sites": args.min_sites, "timeout": args.timeout}
    if args.target == "toy":
        setup.update(interval=args.interval, steps=args.steps, step_seconds=args.step_seconds,
                     compression=args.compression)
    else:
        setup.update(ranks_per_site=args.ranks_per_site, job=list(job))
        if getattr(args, "wan_rate_mbit", 0):  # (absent on loopback: earlier baselines stay valid)
            setup.update(wan_rate_mbit=args.wan_rate_mbit, wan_delay_ms=args.wan_delay_ms)
    return setup


def save_baseline(out: str, setup: Dict, base: Dict) -> None:
    write_json(os.path.join(out, "baseline.json"), {"setup": setup, "run": base})


def load_baseline(directory: str, setup: Dict) -> Dict:
    """The fault-free run saved in `directory` (its baseline.json), checked to be this job's."""
    path = os.path.join(directory, "baseline.json")
    fix = "it is written by a run without --baseline-from"
    try:
        saved = read_json_object(path, "baseline", fix)
    except OSError as err:
        raise ValueError(f"cannot read {path} ({err.strerror}); {fix}")
    if not isinstance(saved.get("setup"), dict) or not isinstance(saved.get("run"), dict):
        raise ValueError(f"baseline {path} lacks its setup or run (not written by this tool?); {fix}")
    differ = sorted(k for k in set(setup) | set(saved.get("setup", {})) if setup.get(k) != saved["setup"].get(k))
    if differ:
        raise ValueError(f"its baseline ran another job (differs in: {', '.join(differ)})")
    base = saved["run"]
    for key in ("codes", "texts", "records"):  # JSON made their site numbers strings
        if key in base:
            base[key] = {int(k): v for k, v in base[key].items()}
    return base


# ---- command line ---------------------------------------------------------------------------------
def _fault_flags(args) -> Optional[str]:
    """Settle --faults (from --kill where given) and the WAN flags; the problem, if any, as the
    error line says it (naming the flag)."""
    if args.kill and args.faults:
        return "--kill and --faults: give one (--kill K is --faults K)"
    kinds = (args.faults or args.kill or "site").split(",")
    unknown = [k for k in kinds if k not in FAULT_KINDS]
    if unknown:
        return f"--faults {args.faults}: {unknown[0]!r} is not one of {', '.join(FAULT_KINDS)}"
    if args.wan_rate_mbit < 0 or args.wan_delay_ms < 0:
        return "--wan-rate-mbit and --wan-delay-ms must be >= 0"
    if args.target == "toy" and (args.wan_rate_mbit or args.faults or args.kill):
        return "--wan-rate-mbit, --faults and --kill are for --target pretrain"
    if "cut" in kinds and not args.wan_rate_mbit:
        return "--faults cut needs --wan-rate-mbit (a link to cut: the emulated WAN)"
    args.faults = kinds
    args.freeze_s = args.freeze_s if args.freeze_s is not None else 2 * args.timeout
    for flag, value in (("--freeze-s", args.freeze_s), ("--cut-s", args.cut_s)):
        if value <= 0:
            return f"{flag} {value:g}: must be > 0"
    return None


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    job: List[str] = []
    if "--" in argv:
        job = argv[argv.index("--") + 1:]
        argv = argv[:argv.index("--")]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="%(prog)s [options] [-- pretrain_gpt.py flags]")
    p.add_argument("--target", choices=("pretrain", "toy"), default="pretrain",
                   help="pretrain: pretrain_gpt.py sites; toy: tools/benchmarks/elastic/ft_site.py sites")
    p.add_argument("--sites", type=int, default=3)
    p.add_argument("--min-sites", type=int, default=2)
    p.add_argument("--fault-every", type=float, default=10.0, help="seconds between faults")
    p.add_argument("--max-down", type=int, default=0,
                   help="most sites down at once (default: --sites minus --min-sites, so the floor is never hit)")
    p.add_argument("--timeout", type=float, default=5.0, help="--lsgd-ft-timeout of the sites")
    p.add_argument("--max-minutes", type=float, default=5.0, help="give up (and fail) after this long, per run")
    p.add_argument("--join-ms", type=int, default=0,
                   help="the lighthouse's join timeout (ms; default 5000 pretrain, 3000 toy): how long a quorum "
                        "waits for a live site that has not asked yet, counted from the first site that asked. "
                        "Above a round's wall time, or a site restarted mid-round, which waits at the lighthouse, "
                        "has spent it when the survivors come: the first one meets it, the other is left out "
                        "and healed a round later (docs/fault_tolerance.md, \"One heal per fault\")")
    p.add_argument("--heartbeat-ms", type=int, default=0,
                   help="the lighthouse's heartbeat timeout (ms; default 2000 pretrain, 1000 toy): a dead site "
                        "delays a quorum this long")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="")
    p.add_argument("--baseline-from", default="", metavar="DIR",
                   help="reuse the fault-free run of an earlier --out-dir (the same job and sites) instead of "
                        "running it again, e.g. to try several --fault-every on one baseline")
    pre = p.add_argument_group("pretrain target")
    pre.add_argument("--ranks-per-site", type=int, default=1)
    pre.add_argument("--faults", default=None, metavar="KINDS",
                     help="comma-separated, taken in turn (default site): site: SIGKILL the site's torchrun and "
                          "every rank, then start it again; rank: SIGKILL one rank, torchrun (--max-restarts) "
                          "restarts the site's ranks; freeze: SIGSTOP the site for --freeze-s, then SIGCONT; cut: "
                          "its link down for --cut-s (needs --wan-rate-mbit)")
    pre.add_argument("--kill", choices=("site", "rank"), default=None, help="one kind only: --faults site or rank")
    pre.add_argument("--max-restarts", type=int, default=100, help="torchrun's, for rank faults")
    pre.add_argument("--freeze-s", type=float, default=None, help="how long a freeze lasts (default 2 x --timeout)")
    pre.add_argument("--cut-s", type=float, default=30.0, help="how long a cut lasts")
    pre.add_argument("--wan-rate-mbit", type=float, default=0.0,
                     help="run the sites in the emulated WAN at this rate (tools/wan; root; default 0: loopback)")
    pre.add_argument("--wan-delay-ms", type=float, default=0.0, help="its one-way delay")
    toy = p.add_argument_group("toy target")
    toy.add_argument("--interval", type=int, default=4, help="H")
    toy.add_argument("--steps", type=int, default=400, help="inner steps of the job (every site)")
    toy.add_argument("--step-seconds", type=float, default=0.05, help="sleep per toy inner step")
    toy.add_argument("--compression", default="none", choices=("none", "int8", "int4"))
    args = p.parse_args(argv)
    if args.sites < 2 or not 1 <= args.min_sites <= args.sites:
        print("error: --sites must be >= 2 and --min-sites in [1, --sites]", file=sys.stderr)
        return 2
    if args.min_sites == args.sites:
        print("error: --min-sites equal to --sites leaves no site to lose: every fault pauses the job", file=sys.stderr)
        return 2
    if job and args.target == "toy":
        print("error: pretrain_gpt.py flags after -- need --target pretrain", file=sys.stderr)
        return 2
    problem = _fault_flags(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    args.max_down = args.max_down or args.sites - args.min_sites
    args.join_ms = args.join_ms or (3000 if args.target == "toy" else 5000)
    args.heartbeat_ms = args.heartbeat_ms or (1000 if args.target == "toy" else 2000)
    if args.target == "toy":
        run, summarize = run_toy_job, summarize_toy
    else:
        job = job or DEFAULT_JOB
        if _flag(job, "--train-iters") is None:
            print("error: the job after -- needs --train-iters", file=sys.stderr)
            return 2

        def run(a, out_dir, faults):
            return run_pretrain_job(a, job, out_dir, faults)
        summarize = summarize_pretrain
    setup = job_setup(args, job)
    base = None
    if args.baseline_from:
        try:
            base = load_baseline(args.baseline_from, setup)
        except ValueError as err:
            print(f"error: --baseline-from {args.baseline_from}: {err}", file=sys.stderr)
            return 2
    # absolute: the sites run from the repository, their checkpoint and digest paths must not move with them
    out = os.path.abspath(args.out_dir or tempfile.mkdtemp(prefix="chaos-"))
    if base is not None:
        print(f"[chaos] baseline from {args.baseline_from}: {base['wall_s']:.1f} s")
    else:
        base = run(args, os.path.join(out, "baseline"), faults=False)
        if set(base["codes"].values()) != {0}:
            print(f"error: the fault-free baseline failed (exit codes {base['codes']}; see {out}/baseline)",
                  file=sys.stderr)
            return 1
        save_baseline(out, setup, base)
        print(f"[chaos] baseline: {base['wall_s']:.1f} s")
    chaos = run(args, os.path.join(out, "chaos"), faults=True)
    summary = summarize(args, base, chaos)
    if args.target == "toy":  # who met whom around each kill (docs/fault_tolerance.md, "One heal per fault")
        write_text(os.path.join(out, "timeline.txt"), "\n".join(timeline(chaos["records"], chaos["kills"])) + "\n")
    write_json(os.path.join(out, "chaos.json"), summary, indent=1)
    for key, value in summary.items():
        print(f"{key}: {value}")
    print(f"[chaos] logs, digests and chaos.json in {out}")
    ok = summary["job_finished"] and not summary["digest_disagreements"]
    return 0 if ok else 1


if __name__ == "__main__":
    with tool_errors():
        sys.exit(main())
