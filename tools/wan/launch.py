"""Launch a training run across emulated sites: one `torchrun` per site inside its namespace.

    python -m tools.wan.launch --sites 2 --ranks-per-site 1 --rate-mbit 100 --delay-ms 20 -- \\
        pretrain_gpt.py --num-layers 4 --hidden-size 256 ... --lsgd-algorithm sync

Site i runs `torchrun --nnodes S --node-rank i --nproc-per-node R --master-addr <site 0>`
with GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME = wan0, so node-major placement makes each
site a contiguous rank block (what --num-sites expects; it is appended when missing).
If one site fails, the others are stopped; on exit, Ctrl-C or SIGTERM every process
started here is stopped and the namespaces are deleted. The flags of this repository's
pretrain_gpt.py are checked before anything starts: a mistake is one `error:` line, exit 2.

With `--lsgd-fault-tolerance torchft` among the script's flags (docs/fault_tolerance.md)
each site is a job of its own instead: site i runs `torchrun --nnodes 1 --max-restarts N
--master-addr <site i>` with `--lsgd-site i`, a torchft lighthouse runs in site 0's
namespace (unless the script names one with --lsgd-lighthouse), and a site that fails does
not stop the others: torchrun restarts it (--max-restarts) and it rejoins.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

if __package__ in (None, ""):  # python tools/wan/launch.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tools.wan.link import LinkSpec  # noqa: E402
from megatron_lsgd import cli  # noqa: E402
from tools.wan.netns import WanError  # noqa: E402
from tools.wan.preflight import BACKENDS  # noqa: E402
from tools.wan.topology import IFNAME, REPO_ROOT, WanTopology  # noqa: E402


class JobError(RuntimeError):
    """A job this launcher depends on stopped (the lighthouse)."""


@dataclass
class SiteJob:
    site: int  # namespace it runs in
    cmd: List[str]
    log_path: str


def site_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    env.update(GLOO_SOCKET_IFNAME=IFNAME, NCCL_SOCKET_IFNAME=IFNAME, PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


def torchrun_cmd(nnodes: int, node_rank: int, nproc: int, master_addr: str, master_port: int,
                 script_argv: Sequence[str], max_restarts: int = 0) -> List[str]:
    restarts = ["--max-restarts", str(max_restarts)] if max_restarts else []
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node-rank", str(node_rank),
            "--nproc-per-node", str(nproc), "--master-addr", master_addr, "--master-port", str(master_port),
            *restarts, *script_argv]


def script_flag(script: Sequence[str], flag: str) -> Optional[str]:
    """The value the script's last `flag` (or `flag=value`) gives, None when absent."""
    value = None
    for i, arg in enumerate(script):
        if arg == flag and i + 1 < len(script):
            value = script[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
    return value


def lighthouse_floor(script: Sequence[str]) -> int:
    """The lighthouse's --min_replicas for the script's sites: their --lsgd-min-sites, or 1
    when a site alone may train (--lsgd-ft-lone-site train: a quorum of one site must form)."""
    if script_flag(script, "--lsgd-ft-lone-site") == "train":
        return 1
    return int(script_flag(script, "--lsgd-min-sites") or 1)


def lighthouse_cmd(min_sites: int, port: int, join_timeout_ms: int,
                   heartbeat_timeout_ms: Optional[int] = None) -> List[str]:
    """torchft's lighthouse (installed with torchft): forms each round's quorum of sites
    (`heartbeat_timeout_ms`: how soon a silent site is dropped; torchft's default 5 s)."""
    exe = shutil.which("torchft_lighthouse")
    if exe is None:
        raise ValueError('--lsgd-fault-tolerance torchft needs torchft\'s torchft_lighthouse, which is not installed; '
                         'install it with pip install -e ".[ft]"')
    heartbeat = ["--heartbeat_timeout_ms", str(heartbeat_timeout_ms)] if heartbeat_timeout_ms else []
    return [exe, "--min_replicas", str(min_sites), "--bind", f"[::]:{port}", "--join_timeout_ms",
            str(join_timeout_ms), "--quorum_tick_ms", "100", *heartbeat]


def elastic_site_flags(site: int, lighthouse: str, host: str) -> List[str]:
    """What an elastic site's script gets beside the user's flags."""
    return ["--lsgd-site", str(site), "--lsgd-lighthouse", lighthouse, "--lsgd-ft-host", host]


def elastic_site_jobs(wan: WanTopology, ranks_per_site: int, script_argv: Sequence[str], port: int, log_dir: str,
                      name: str, lighthouse: str, max_restarts: int) -> List[SiteJob]:
    """One job per site (fault tolerance): its own rendezvous on its own host, its --lsgd-site,
    the address the other sites reach it at (--lsgd-ft-host)."""
    return [SiteJob(i, torchrun_cmd(1, 0, ranks_per_site, wan.site_ip(i), port,
                                    [*script_argv, *elastic_site_flags(i, lighthouse, wan.site_ip(i))],
                                    max_restarts),
                    os.path.join(log_dir, f"{name}.site{i}.log")) for i in range(wan.sites)]


def multi_site_jobs(wan: WanTopology, ranks_per_site: int, script_argv: Sequence[str], port: int,
                    log_dir: str, name: str) -> List[SiteJob]:
    """One job spanning every site (the rendezvous store lives on site 0)."""
    return [SiteJob(i, torchrun_cmd(wan.sites, i, ranks_per_site, wan.site_ip(0), port, script_argv),
                    os.path.join(log_dir, f"{name}.site{i}.log")) for i in range(wan.sites)]


def stop_all(procs: Sequence[subprocess.Popen], grace_s: float = 10.0) -> None:
    """Stop jobs started here: SIGTERM to each one's own process group (torchrun and its
    workers) at once, SIGKILL to those still running `grace_s` later. All together, so that
    Ctrl-C takes one grace period however many sites there are."""
    signalled = []
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                signalled.append(proc)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for proc in signalled:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for proc in procs:
        proc.wait()


def run_jobs(wan: WanTopology, jobs: Sequence[SiteJob], timeout_s: float,
             env: Optional[Dict[str, str]] = None, stop_on_failure: bool = True,
             services: Sequence[SiteJob] = ()) -> List[int]:
    """Start every job in its site's namespace, wait for all; the first failure (unless not
    `stop_on_failure`: elastic sites outlive each other) or the timeout stops the rest.
    `services` (a lighthouse) start first and are stopped at the end. Returns the jobs' exit
    codes (None-free)."""
    procs: List[subprocess.Popen] = []
    running: List[subprocess.Popen] = []
    logs = []
    try:
        for job in services:
            os.makedirs(os.path.dirname(os.path.abspath(job.log_path)), exist_ok=True)
            log = open(job.log_path, "w")
            logs.append(log)
            running.append(subprocess.Popen(wan.in_site(job.site, job.cmd), cwd=REPO_ROOT, env=site_env(env),
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        for job in jobs:
            os.makedirs(os.path.dirname(os.path.abspath(job.log_path)), exist_ok=True)
            log = open(job.log_path, "w")
            logs.append(log)
            procs.append(subprocess.Popen(wan.in_site(job.site, job.cmd), cwd=REPO_ROOT, env=site_env(env),
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in procs]
            if (stop_on_failure and any(c not in (None, 0) for c in codes)) or all(c is not None for c in codes):
                break
            if any(s.poll() is not None for s in running):
                raise JobError("the lighthouse stopped; its log: " + ", ".join(j.log_path for j in services))
            if time.monotonic() > deadline:
                raise TimeoutError(f"jobs still running after {timeout_s:.0f} s; logs: "
                                   + ", ".join(j.log_path for j in jobs))
            time.sleep(0.2)
    finally:
        stop_all(procs + running)
        for log in logs:
            log.close()
    return [p.returncode for p in procs]


def raise_on_termination() -> None:
    """SIGTERM/SIGHUP unwind like Ctrl-C, so `with WanTopology(...)` tears down."""
    def handler(signum, _frame):
        raise SystemExit(128 + signum)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


def add_link_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("emulated WAN")
    g.add_argument("--sites", type=int, default=2)
    g.add_argument("--rate-mbit", type=float, default=100.0, help="each site's link, each direction")
    g.add_argument("--delay-ms", type=float, default=20.0, help="one-way delay between sites")
    g.add_argument("--jitter-ms", type=float, default=0.0)
    g.add_argument("--loss-pct", type=float, default=0.0)
    g.add_argument("--queue-ms", type=float, default=100.0, help="rate limiter backlog before tail drop")
    g.add_argument("--link-backend", choices=BACKENDS, default="auto",
                   help="tc: veth + tbf/netem; tun: userspace wire (kernels without sch_netem); auto: tc if possible")
    g.add_argument("--subnet", default="10.77.0", help="private /24 used only inside the namespaces")


def topology_from_args(a: argparse.Namespace) -> WanTopology:
    return WanTopology(a.sites, LinkSpec(a.rate_mbit, a.delay_ms, a.jitter_ms, a.loss_pct, a.queue_ms),
                       backend=a.link_backend, subnet=a.subnet)


def check_training_flags(script: Sequence[str], world_size: int, elastic: bool) -> None:
    """This repository's pretrain_gpt.py: its flags checked once here, before any namespace or
    site exists, so a mistake is one `error:` line from the launcher (exit 2) instead of one per
    rank in each site's log, repeated by every torchrun restart of an elastic site. Other
    scripts are left to check their own flags. Raises ValueError; argparse exits 2 itself."""
    path = os.path.join(REPO_ROOT, script[0]) if script else ""  # the sites run in REPO_ROOT
    if not os.path.isfile(path) or not os.path.samefile(path, os.path.join(REPO_ROOT, "pretrain_gpt.py")):
        return
    from megatron_lsgd.training.arguments import build_config, build_parser  # torch: only when needed

    site_flags = elastic_site_flags(0, "http://127.0.0.1:1", "127.0.0.1") if elastic else []
    parser = build_parser()
    parser.prog = "pretrain_gpt.py"
    here = os.getcwd()
    os.chdir(REPO_ROOT)  # relative paths in the flags (a scenario file) as the sites read them
    try:
        build_config(parser.parse_args([*script[1:], *site_flags]), world_size)
    finally:
        os.chdir(here)


def _run_elastic(wan: WanTopology, a: argparse.Namespace, script: List[str]) -> List[int]:
    """One job per site, restarted by torchrun, and a lighthouse in site 0 unless the script names one."""
    lighthouse, services = script_flag(script, "--lsgd-lighthouse"), []
    if lighthouse is None:
        cmd = lighthouse_cmd(lighthouse_floor(script), a.lighthouse_port, a.lighthouse_join_timeout_ms)
        services = [SiteJob(0, cmd, os.path.join(a.log_dir, "lighthouse.log"))]
        lighthouse = f"http://{wan.site_ip(0)}:{a.lighthouse_port}"
        print(f"lighthouse: {lighthouse} (in site 0)", flush=True)
    jobs = elastic_site_jobs(wan, a.ranks_per_site, script, a.master_port, a.log_dir, "run", lighthouse,
                             a.max_restarts)
    return run_jobs(wan, jobs, a.timeout, stop_on_failure=False, services=services)


def main(argv: Optional[List[str]] = None) -> int:
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_link_args(p)
    p.add_argument("--ranks-per-site", type=int, default=1)
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--log-dir", default="runs/wan_launch")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before every site is stopped")
    g = p.add_argument_group("elastic sites (with --lsgd-fault-tolerance torchft in the script's flags)")
    g.add_argument("--max-restarts", type=int, default=3, help="torchrun restarts of a failed site")
    g.add_argument("--lighthouse-port", type=int, default=29510, help="port of the lighthouse started in site 0")
    g.add_argument("--lighthouse-join-timeout-ms", type=int, default=10000,
                   help="how long a quorum waits for a live site that is late to a round's end")
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- pretrain_gpt.py and its flags")
    a = p.parse_args(argv)
    script = a.script[1:] if a.script[:1] == ["--"] else a.script
    if not script:
        p.error("give the training script after --, e.g. -- pretrain_gpt.py --num-layers 2 ...")
    if a.ranks_per_site < 1 or not a.timeout > 0:
        p.error("--ranks-per-site must be >= 1 and --timeout > 0")
    if a.max_restarts < 0:
        p.error("--max-restarts must be >= 0")
    if "--num-sites" not in script:
        script += ["--num-sites", str(a.sites)]
    elastic = script_flag(script, "--lsgd-fault-tolerance") not in (None, "none")
    raise_on_termination()
    try:
        topology = topology_from_args(a)  # its flags are checked before the script's
        check_training_flags(script, a.ranks_per_site * (1 if elastic else a.sites), elastic)
        with topology as wan:
            print(f"wan: {a.sites} sites, backend {wan.backend}, {a.rate_mbit} Mbit/s, {a.delay_ms} ms one-way; "
                  f"logs in {a.log_dir}", flush=True)
            if elastic:
                codes = _run_elastic(wan, a, script)
            else:
                codes = run_jobs(wan, multi_site_jobs(wan, a.ranks_per_site, script, a.master_port, a.log_dir,
                                                      "run"), a.timeout)
    except (WanError, TimeoutError, ValueError, JobError) as err:  # ValueError: link or topology flags
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: every site stopped, namespaces deleted", file=sys.stderr)
        return 130
    print(f"exit codes per site: {codes}", flush=True)
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
