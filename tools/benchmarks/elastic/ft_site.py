"""One site of an elastic DiLoCo job on a flat toy model: what chaos.py kills and restarts
and what the fault-tolerance tests drive (tests/unit_tests/lsgd/test_fault_tolerance.py).

The synchronizer, its outer state, compressors and cross-site means are the real ones
(`diloco`, through `TorchftMembership` and `ElasticComm`); only the inner step is a toy:
each step adds a deterministic, dyadic (exact in fp32) update that depends on the site and
its step, through an inner momentum buffer. So a run's numbers can be replayed exactly
(`replay_round`) and a site's whole resumable state is small: parameters, inner momentum,
step (= data position and schedule), and the synchronizer's state (anchor, outer
momentum, error feedback, round position).

Every committed round is appended to `<out>/site<k>.jsonl` as it happens (a killed site
keeps what it wrote): committed-round count, step, SHA-256 of anchor + outer momentum, and
the anchor/momentum values (the toy model is tiny).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from types import SimpleNamespace
from typing import List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

from megatron_lsgd.core.lsgd import catalog  # noqa: E402
from megatron_lsgd.core.lsgd.comm import InterSiteComm, InterSiteTimeout  # noqa: E402
from megatron_lsgd.core.lsgd.config import CompressionOptions, LsgdConfig, OuterOptions, RoundOptions  # noqa: E402
from megatron_lsgd.core.lsgd.membership import AllSites  # noqa: E402
from megatron_lsgd.core.lsgd.protocol import SyncContext  # noqa: E402
from megatron_lsgd.core.optimizer.shard_views import BucketExtent, PieceView, ShardRange, ShardViews  # noqa: E402
from megatron_lsgd.core.parallel_state import ParallelDims  # noqa: E402

NUMEL = 8


@dataclass
class SiteSpec:
    site: int
    num_sites: int
    steps: int  # inner steps this site's job runs (its data budget)
    interval: int = 2  # H
    out_dir: str = "."
    lighthouse: str = ""  # "" : no fault tolerance (a plain gloo world over all sites)
    min_sites: int = 1
    compression: str = "none"
    timeout_s: float = 5.0
    step_seconds: float = 0.0  # sleep per inner step (chaos: make rounds take wall time)
    kill_at_step: Optional[int] = None  # SIGKILL itself after this step (a site failing mid-round)
    world_port: int = 0  # the plain world's port (lighthouse == "")
    go_file: str = ""  # wait for this file before the first step (every site's manager heartbeats by then)
    pause_file: str = ""  # no inner step while this file exists (tests: hold the others while a site restarts)
    max_wait_s: float = 600.0  # --lsgd-ft-max-wait
    lone_site: str = "stop"  # --lsgd-ft-lone-site
    log_every: float = 1.0  # seconds between a waiting site's lines (pretrain_gpt.py: 10)


def inner_update(site: int, step: int) -> torch.Tensor:
    """The toy data: a dyadic update per element (exact in fp32, order-free sums)."""
    j = torch.arange(NUMEL, dtype=torch.float32)
    return (((site + 1) * (step % 7 + 1) * (j + 1)) % 13 - 6) / 64


def initial_params() -> torch.Tensor:
    return (torch.arange(NUMEL, dtype=torch.float32) - 3) / 8


class FlatOptimizer:
    """The optimizer surface a synchronizer touches, over one flat fp32 shard."""

    sharded = False  # one rank per site: nothing to split across a site (site_split.SiteSplit)

    def __init__(self, shard: torch.Tensor):
        self.shard = shard
        n = shard.numel()
        self._views = ShardViews("all", ("*",), [ShardRange(0, 0, n)], [PieceView("w", (n,), 0, n, 0, 0, n)],
                                 [shard[0:n]], [torch.zeros_like(shard)], [BucketExtent(0, 0, n)], whole=True)

    def main_param_shards(self) -> List[torch.Tensor]:
        return [self.shard]

    def views(self, units=None) -> ShardViews:
        return self._views

    def copy_main_to_model_params(self, views=None) -> None:
        pass  # the shard is the model


def digest(sync) -> str:
    h = hashlib.sha256()
    for t in sync.outer.anchors + sync.outer.momenta:
        h.update(t.numpy().tobytes())
    return h.hexdigest()


@dataclass
class SiteState:
    params: torch.Tensor = field(default_factory=initial_params)
    inner_momentum: torch.Tensor = field(default_factory=lambda: torch.zeros(NUMEL))
    step: int = 0  # data position and schedule: the next inner step


def lsgd_config(spec: SiteSpec) -> LsgdConfig:
    cls = catalog.synchronizer_class("diloco")
    cfg = LsgdConfig(algorithm="diloco", rounds=RoundOptions(interval=spec.interval),
                     outer=OuterOptions(lr=0.5, momentum=0.5), compression=CompressionOptions(kind=spec.compression),
                     algo=cls.Options())
    catalog.validate(cfg, spec.num_sites)
    return cfg


def run_site(spec: SiteSpec) -> None:
    torch.set_num_threads(1)
    state = SiteState()
    optimizer = FlatOptimizer(state.params)
    cfg = lsgd_config(spec)
    log_path = os.path.join(spec.out_dir, f"site{spec.site}.jsonl")
    logf = open(log_path, "a")

    def log(msg: str) -> None:
        logf.write(json.dumps({"log": msg, "t": time.time()}) + "\n")
        logf.flush()

    def trace(record: dict) -> None:  # TorchftMembership's quorum and round events (chaos.py's timeline)
        logf.write(json.dumps({**record, "t": time.time()}) + "\n")
        logf.flush()

    membership, world = AllSites(), False
    if spec.lighthouse:
        from torch.distributed import TCPStore

        from megatron_lsgd.core.lsgd.fault_tolerance.elastic_comm import ElasticComm
        from megatron_lsgd.core.lsgd.fault_tolerance.options import FaultToleranceOptions
        from megatron_lsgd.core.lsgd.fault_tolerance.torchft_membership import TorchftMembership

        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # this site's own store
        comm = ElasticComm(spec.num_sites, site=spec.site)
        options = FaultToleranceOptions(mode="torchft", min_sites=spec.min_sites, lighthouse=spec.lighthouse,
                                        timeout_s=spec.timeout_s, max_wait_s=spec.max_wait_s,
                                        lone_site=spec.lone_site)
        options.validate(algorithm="diloco", num_sites=spec.num_sites)
        membership = TorchftMembership(comm, options, site=spec.site, group_rank=0, group_world_size=1,
                                       store_addr="127.0.0.1", store_port=store.port, device=torch.device("cpu"),
                                       log=log, log_every=spec.log_every, poll_s=0.2, trace=trace)
    else:  # the same job without fault tolerance: one gloo world over the sites
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec.world_port}", rank=spec.site,
                                world_size=spec.num_sites, timeout=timedelta(seconds=60))
        comm, world = InterSiteComm(dist.group.WORLD, spec.num_sites, site=spec.site), True
    pgs = SimpleNamespace(site=None, dims=ParallelDims(), dp_intra_rank=0,
                          dp_intra=None, dp_intra_size=1, inter_lanes=[])  # one rank per site, sites equal
    ctx = SyncContext(pgs=pgs, config=cfg, models=[], optimizer=optimizer, comm=comm, membership=membership)
    sync = catalog.synchronizer_class("diloco")(ctx)

    if spec.lighthouse:
        def snapshot():
            return {"params": state.params.clone(), "inner_momentum": state.inner_momentum.clone(),
                    "step": state.step, "sync": sync.state_dict()}

        def restore(saved):
            state.params.copy_(saved["params"])
            state.inner_momentum.copy_(saved["inner_momentum"])
            state.step = int(saved["step"])
            sync.load_state_dict(saved["sync"])

        membership.register_state("site", snapshot, restore)

    log(json.dumps({"started": spec.site}))
    while spec.go_file and not os.path.exists(spec.go_file):
        time.sleep(0.05)
    try:
        train(spec, state, sync, membership, logf)
    except InterSiteTimeout as err:  # pretrain_gpt.py's one error line and exit code 2
        logf.write(json.dumps({"error": str(err), "t": time.time()}) + "\n")
        logf.flush()
        sys.exit(2)
    logf.write(json.dumps({"done": spec.site, "step": state.step, "t": time.time()}) + "\n")
    logf.flush()
    if spec.lighthouse:
        membership.close()
    if world:
        import torch.distributed as dist

        dist.destroy_process_group()


def train(spec: SiteSpec, state: SiteState, sync, membership, logf) -> None:
    """The site's inner steps and rounds to the end of its budget."""
    while state.step < spec.steps:
        sync.before_forward_backward(state.step)  # a quorum at a round's start; a heal may move state.step
        if state.step >= spec.steps or sync.ended() is not None:  # (ended: healed to the job's final state)
            break
        step = state.step
        while spec.pause_file and os.path.exists(spec.pause_file):
            time.sleep(0.05)
        if spec.step_seconds:
            time.sleep(spec.step_seconds)
        with torch.no_grad():
            state.inner_momentum.mul_(0.5).add_(inner_update(spec.site, step))
            state.params.add_(state.inner_momentum)
        state.step += 1
        rounds_before = sync.outer_rounds
        sync.after_optimizer_step(step, True)
        if sync.outer_rounds != rounds_before:
            committed = membership.committed_rounds if spec.lighthouse else sync.outer_rounds
            logf.write(json.dumps({"round": committed, "step": state.step, "digest": digest(sync),
                                   "committed": getattr(membership, "rounds_committed", sync.outer_rounds),
                                   "attempted": getattr(membership, "rounds_attempted", sync.outer_rounds),
                                   "anchor": sync.outer.anchors[0].tolist(),
                                   "momentum": [m.tolist() for m in sync.outer.momenta],
                                   "error": [e.tolist() for e in sync.compressor.errors],
                                   "t": time.time()}) + "\n")
            logf.flush()
        if spec.kill_at_step is not None and state.step == spec.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)


def start_lighthouse(min_sites: int, heartbeat_timeout_ms: int = 1000, join_timeout_ms: int = 3000):
    """A torchft lighthouse in this process (loopback, a free port). A site that has stopped
    heartbeating (dead) is dropped after `heartbeat_timeout_ms`; a live one that reaches the
    round's quorum late is waited for up to `join_timeout_ms` (shorter, and a loaded machine
    splits the sites: the late one is left out of the round and heals at the next). The
    window counts from the first site that asks: keep it above a round's wall time, or a
    site restarted mid-round has spent it when the others come (docs/fault_tolerance.md,
    "One heal per fault")."""
    from torchft._torchft import LighthouseServer

    return LighthouseServer(bind="[::]:0", min_replicas=min_sites, join_timeout_ms=join_timeout_ms,
                            heartbeat_timeout_ms=heartbeat_timeout_ms)


def launch(spec: SiteSpec):
    """Start one site as its own process (SIGKILL-able); its output goes to <out>/site<k>.out."""
    import dataclasses
    import subprocess

    out = open(os.path.join(spec.out_dir, f"site{spec.site}.out"), "a")
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), json.dumps(dataclasses.asdict(spec))],
                            stdout=out, stderr=subprocess.STDOUT, cwd=REPO)


def starts(records: List[dict]) -> List[int]:
    """Indices of the records where a process of the site started (a restart appends)."""
    return [i for i, r in enumerate(records) if r.get("log", "").startswith('{"started"')]


def wait_started(out_dir: str, sites, timeout_s: float = 120.0, times: int = 1) -> None:
    """Until every site in `sites` has built its manager `times` times (restarts count)."""
    deadline = time.time() + timeout_s
    while not all(len(starts(read_log(out_dir, s))) >= times for s in sites):
        if time.time() > deadline:
            raise TimeoutError(f"sites {list(sites)} did not start in {timeout_s:.0f} s (see {out_dir}/site*.out)")
        time.sleep(0.05)


def read_log(out_dir: str, site: int) -> List[dict]:
    path = os.path.join(out_dir, f"site{site}.jsonl")
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # the line a running (or killed) site is writing
                break
    return records


if __name__ == "__main__":
    run_site(SiteSpec(**json.loads(sys.argv[1])))
