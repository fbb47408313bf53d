"""`--simulate-clock`: the run's time from a cost model instead of the wall clock.

A *scenario* (a small TOML file, tools/benchmarks/scenarios/) says what is simulated: the
sites, each site's compute costs (given per micro-batch of the trained model, or derived
from a target model size, tokens per micro-batch and sustained FLOP/s), the bytes-scale
(target parameters / trained parameters: a tiny CPU model's bytes stand for a large
model's), each site's link rate and one-way delay, and slow sites. Without a scenario the
defaults below apply. `--simulate-inter-site-bandwidth/-latency` override the scenario's
link for every site (0 bandwidth: unlimited, as without the simulated clock), the
`--simulate-*-seconds` flags its compute, and `--simulate-slow-ranks`/`--slow-factor`
make a rank's compute cost factor x. The clock itself is core/simulation.py.

    description = "2 sites x 8 GPUs, 1 Gbit/s, 30 ms, a 1B model"
    sites = 2
    # replicas_per_site = [2, 1]   # sites of different sizes: the run's --site-data-parallel-sizes
    [compute]
    target_params = 1.0e9          # derive microbatch_seconds = 6 N tokens / (GPUs x FLOP/s)
    tokens_per_microbatch = 65536  # tokens one replica computes per trained micro-batch
    gpus_per_replica = 8
    sustained_tflops = 400         # per GPU, achieved
    # microbatch_seconds = 0.05    # or give it directly
    optimizer_step_seconds = 0.004 # default: 16 bytes per parameter of the GPU's share, read
                                   # and written at hbm_gbyte_s (3000)
    intra_site_gbit = 400
    site_factors = [1.0, 1.0]      # compute slowdown per site
    [link]
    rate_mbit = 1000               # one value, or one per site
    latency_ms = 30
    target_params = 1.0e9          # bytes_scale = this / trained parameters (or bytes_scale = x)
    cpu_seconds_per_mb = 0         # compute a sent MB takes from its rank (the network stack on the
                                   # ranks' cores, as in the emulated WAN on a small machine; a
                                   # GPU's NIC: 0); tools/wan/collective_probe.py measures it
    delays_per_phase = 1           # one-way delays per phase of a collective (a ring all-reduce
                                   # over S sites has 2 (S - 1) phases); gloo after an idle gap:
                                   # about 2, which validate_clock.py --probe-only measures
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_lsgd.core.options import OptionGroup, option
from megatron_lsgd.core.simulation import CostModel, LinkModel, SimulatedClock

DEFAULT_MICROBATCH_SECONDS = 0.05
DEFAULT_OPTIMIZER_STEP_SECONDS = 0.005
DEFAULT_INTRA_SITE_GBIT = 100.0
DEFAULT_HBM_GBYTE_S = 3000.0
COMPUTE_KEYS = {"target_params", "tokens_per_microbatch", "gpus_per_replica", "sustained_tflops", "microbatch_seconds",
                "optimizer_step_seconds", "hbm_gbyte_s", "intra_site_gbit", "site_factors"}
LINK_KEYS = {"rate_mbit", "latency_ms", "target_params", "bytes_scale", "cpu_seconds_per_mb", "delays_per_phase"}


@dataclass
class SimulationOptions(OptionGroup):
    title = "simulated clock (deterministic timing for benchmarks; nothing sleeps)"
    enabled: bool = option("--simulate-clock", False,
                           "time the run on a simulated clock: compute from a cost model, inter-site collectives "
                           "from a link model; two runs with the same flags give identical logs")
    scenario: Optional[str] = option("--simulate-scenario", None,
                                     "TOML scenario (sites, compute, link; tools/benchmarks/scenarios/); "
                                     "implies --simulate-clock", type=str, metavar="FILE")
    microbatch_seconds: Optional[float] = option(
        "--simulate-microbatch-seconds", None,
        f"simulated forward+backward of one micro-batch through one replica (default: the scenario's, else "
        f"{DEFAULT_MICROBATCH_SECONDS})", type=float)
    optimizer_step_seconds: Optional[float] = option(
        "--simulate-optimizer-step-seconds", None,
        f"simulated inner optimizer step (default: the scenario's, else {DEFAULT_OPTIMIZER_STEP_SECONDS})",
        type=float)
    intra_site_gbit: Optional[float] = option(
        "--simulate-intra-site-bandwidth", None,
        f"Gbit/s of reductions inside a site (default: the scenario's, else {DEFAULT_INTRA_SITE_GBIT:g}; "
        f"0: free)", type=float)
    bytes_scale: Optional[float] = option(
        "--simulate-bytes-scale", None, "inter-site bytes are charged x this (default: the scenario's, else 1)",
        type=float)
    transfer_cpu_seconds_per_mb: Optional[float] = option(
        "--simulate-transfer-cpu-seconds-per-mb", None,
        "simulated compute each MB a rank sends across sites takes from that rank, right after the send is issued "
        "(the network stack sharing the ranks' cores; default: the scenario's, else 0)", type=float)
    delays_per_phase: Optional[float] = option(
        "--simulate-inter-site-delays-per-phase", None,
        "one-way delays (--simulate-inter-site-latency) each phase of an inter-site collective costs; a ring "
        "all-reduce over S sites has 2 (S - 1) phases (default: the scenario's, else 1)", type=float)

    @property
    def active(self) -> bool:
        return self.enabled or self.scenario is not None

    def validate(self, **_) -> None:
        for flag, value in (("--simulate-microbatch-seconds", self.microbatch_seconds),
                            ("--simulate-optimizer-step-seconds", self.optimizer_step_seconds),
                            ("--simulate-intra-site-bandwidth", self.intra_site_gbit),
                            ("--simulate-bytes-scale", self.bytes_scale),
                            ("--simulate-transfer-cpu-seconds-per-mb", self.transfer_cpu_seconds_per_mb),
                            ("--simulate-inter-site-delays-per-phase", self.delays_per_phase)):
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{flag} {value}: must be a finite number >= 0")
        if self.bytes_scale is not None and self.bytes_scale == 0:
            raise ValueError("--simulate-bytes-scale 0: must be > 0")
        if not self.active:
            given = [flag for flag in self.changed_flags() if flag != "--simulate-clock"]
            if given:
                raise ValueError(f"{given[0]} only applies with --simulate-clock (or --simulate-scenario)")
        if self.scenario is not None:
            load_scenario(self.scenario)  # a bad file fails at start, naming itself


# ---- scenarios ------------------------------------------------------------------------------------
@dataclass
class Scenario:
    path: str
    description: str
    sites: int
    microbatch_seconds: float
    optimizer_step_seconds: float
    intra_site_gbit: float
    site_factors: List[float]
    rate_mbit: List[float]
    latency_ms: List[float]
    cpu_seconds_per_mb: float = 0.0
    delays_per_phase: float = 1.0
    bytes_scale: Optional[float] = None  # fixed, or from target_params at run time
    target_params: Optional[float] = None
    derived: Dict[str, str] = field(default_factory=dict)  # how each derived number came about
    # Data-parallel replicas per site when the sites differ in size (None: any equal layout);
    # a run of the scenario must have them as its --site-data-parallel-sizes.
    replicas_per_site: Optional[List[int]] = None

    def bytes_scale_for(self, trained_params: int) -> float:
        if self.bytes_scale is not None:
            return self.bytes_scale
        if self.target_params is not None:
            return self.target_params / max(trained_params, 1)
        return 1.0


def _number(table: dict, key: str, where: str, default=None, positive: bool = False) -> Optional[float]:
    value = table.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 \
            or (positive and value == 0):
        raise ValueError(f"{where}: {key} = {value!r} must be a finite number {'> 0' if positive else '>= 0'}")
    return float(value)


def _per_site(table: dict, key: str, where: str, sites: int, default: float, positive: bool = False) -> List[float]:
    value = table.get(key, default)
    values = value if isinstance(value, list) else [value] * sites
    if len(values) != sites:
        raise ValueError(f"{where}: {key} has {len(values)} values for {sites} sites")
    return [_number({key: v}, key, where, positive=positive) for v in values]


def read_toml(path: str, flag: str) -> Dict:
    """A TOML file's tables; an unreadable or invalid file is a ValueError naming `flag` and the file."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as err:
        raise ValueError(f"{flag} {path}: cannot read it ({err.strerror})") from None
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{flag} {path}: not valid TOML ({err})") from None


def load_scenario(path: str) -> Scenario:
    """Read and check a scenario file; every error names the file and the key."""
    data = read_toml(path, "--simulate-scenario")
    where = f"--simulate-scenario {path}"
    known = {"description", "sites", "replicas_per_site", "compute", "link"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    sites = data.get("sites")
    if not isinstance(sites, int) or sites < 1:
        raise ValueError(f"{where}: sites = {sites!r} must be a whole number >= 1")
    replicas = data.get("replicas_per_site")
    if replicas is not None and not (isinstance(replicas, list) and len(replicas) == sites and all(
            isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in replicas)):
        raise ValueError(f"{where}: replicas_per_site = {replicas!r} must list one whole number >= 1 per site "
                         f"({sites} sites)")
    compute, link = data.get("compute", {}), data.get("link", {})
    for table, name, keys in ((compute, "compute", COMPUTE_KEYS), (link, "link", LINK_KEYS)):
        if not isinstance(table, dict):
            raise ValueError(f"{where}: [{name}] must be a table")
        typos = sorted(set(table) - keys)
        if typos:  # a misspelt key would silently leave its default in force
            raise ValueError(f"{where} [{name}]: unknown key(s) {', '.join(typos)} (known: {', '.join(sorted(keys))})")
    derived: Dict[str, str] = {}

    target = _number(compute, "target_params", f"{where} [compute]", positive=True)
    mb = _number(compute, "microbatch_seconds", f"{where} [compute]", positive=True)  # no site computes in no time
    if target is not None:
        if mb is not None:
            raise ValueError(f"{where} [compute]: give microbatch_seconds or target_params, not both")
        tokens = _number(compute, "tokens_per_microbatch", f"{where} [compute]", positive=True)
        gpus = _number(compute, "gpus_per_replica", f"{where} [compute]", default=1, positive=True)
        tflops = _number(compute, "sustained_tflops", f"{where} [compute]", positive=True)
        if tokens is None or tflops is None:
            raise ValueError(f"{where} [compute]: target_params needs tokens_per_microbatch and sustained_tflops")
        mb = 6 * target * tokens / (gpus * tflops * 1e12)
        derived["microbatch_seconds"] = (f"6 x {target:.3g} params x {tokens:.0f} tokens / ({gpus:g} GPUs x "
                                         f"{tflops:g} TFLOP/s) = {mb:.4g} s")
    opt = _number(compute, "optimizer_step_seconds", f"{where} [compute]")
    if opt is None and target is not None:
        gpus = _number(compute, "gpus_per_replica", f"{where} [compute]", default=1, positive=True)
        hbm = _number(compute, "hbm_gbyte_s", f"{where} [compute]", default=DEFAULT_HBM_GBYTE_S, positive=True)
        opt = 16 * target / gpus / (hbm * 1e9)
        derived["optimizer_step_seconds"] = (f"16 bytes x {target:.3g} params / {gpus:g} GPUs / {hbm:g} GB/s "
                                             f"= {opt:.4g} s")
    link_target = _number(link, "target_params", f"{where} [link]", positive=True)
    scale = _number(link, "bytes_scale", f"{where} [link]", positive=True)
    if link_target is not None and scale is not None:
        raise ValueError(f"{where} [link]: give bytes_scale or target_params, not both")
    return Scenario(
        path=path, description=str(data.get("description", "")), sites=sites,
        microbatch_seconds=DEFAULT_MICROBATCH_SECONDS if mb is None else mb,
        optimizer_step_seconds=DEFAULT_OPTIMIZER_STEP_SECONDS if opt is None else opt,
        intra_site_gbit=_number(compute, "intra_site_gbit", f"{where} [compute]", default=DEFAULT_INTRA_SITE_GBIT),
        site_factors=_per_site(compute, "site_factors", f"{where} [compute]", sites, 1.0, positive=True),
        rate_mbit=_per_site(link, "rate_mbit", f"{where} [link]", sites, 0.0),
        latency_ms=_per_site(link, "latency_ms", f"{where} [link]", sites, 0.0),
        cpu_seconds_per_mb=_number(link, "cpu_seconds_per_mb", f"{where} [link]", default=0.0),
        delays_per_phase=_number(link, "delays_per_phase", f"{where} [link]", default=1.0),
        bytes_scale=scale, target_params=link_target, derived=derived, replicas_per_site=replicas)


# ---- the clock of one rank ---------------------------------------------------------------------------
def trained_parameters(model: torch.nn.Module, pgs) -> int:
    """Parameters of one replica of the trained model, each counted once (a collective over
    the replica's tensor- and pipeline-parallel ranks)."""
    tp = pgs.dims.tp
    local = 0.0
    for p in model.parameters():
        if pgs.dims.pp > 1 and not pgs.is_first_stage and getattr(p, "shared_embedding", False):
            continue  # the last stage's copy of the tied word embedding
        local += p.numel() if getattr(p, "tensor_model_parallel", False) else p.numel() / tp
    total = torch.tensor([local], dtype=torch.float64, device=next(model.parameters()).device)
    if dist.is_initialized() and pgs.model_parallel is not None and dist.get_world_size(pgs.model_parallel) > 1:
        dist.all_reduce(total, group=pgs.model_parallel)
    return int(round(float(total.item())))


def optimizer_shard_scale(dims, site: int, sharded_optimizer: bool) -> float:
    """DP_min / DP_s: a site's optimizer step against the smallest site's under ZeRO-1 (1 with
    sites of equal size or without ZeRO-1; see build_simulated_clock)."""
    return min(dims.site_sizes) / dims.dp_of(site) if sharded_optimizer and dims.heterogeneous else 1.0


def build_simulated_clock(options: SimulationOptions, link_flags, dims, site: int,
                          trained_params: int, streams=None, sharded_optimizer: bool = False) -> SimulatedClock:
    """This rank's simulated clock: scenario, then flags, then defaults (`streams`: the run
    device's, core/streams.py; `sharded_optimizer`: ZeRO-1, whose shard follows the site's size).

    Sites of different data-parallel sizes (docs/heterogeneous_sites.md): every replica computes
    the same micro-batches, so compute costs are the same on every site. The optimizer step is
    the scenario's on the smallest site; under ZeRO-1 a site of DP_s replicas holds DP_min / DP_s
    of that shard and steps that much faster (the smallest site sets the lockstep, as the
    planner's equal-site scenario for the smallest site assumes). What crosses sites is cut into lanes that a
    site's ranks send one after another, each exchange pairing one rank per site, so the
    smallest site sets how many lanes are on a link at once: TP x PP x DP_min ranks share each
    site's link (TP x PP x DP, the site's ranks, when the sites are equal)."""
    scenario = load_scenario(options.scenario) if options.scenario else None  # its sites were checked in build_config

    def pick(flag_value, scenario_value, default):
        if flag_value is not None:
            return flag_value
        return scenario_value if scenario is not None else default

    shard_scale = optimizer_shard_scale(dims, site, sharded_optimizer)
    costs = CostModel(
        microbatch_seconds=pick(options.microbatch_seconds, scenario and scenario.microbatch_seconds,
                                DEFAULT_MICROBATCH_SECONDS),
        optimizer_step_seconds=pick(options.optimizer_step_seconds, scenario and scenario.optimizer_step_seconds,
                                    DEFAULT_OPTIMIZER_STEP_SECONDS) * shard_scale,
        intra_site_gbit=pick(options.intra_site_gbit, scenario and scenario.intra_site_gbit, DEFAULT_INTRA_SITE_GBIT),
        pipeline_stages=dims.pp,
        factor=scenario.site_factors[site] if scenario is not None else 1.0)
    # The link flags keep their meaning; a scenario's link applies where they were left at 0.
    rate = link_flags.bandwidth_mbit or (scenario.rate_mbit[site] if scenario is not None else 0.0)
    latency = link_flags.latency_ms or (scenario.latency_ms[site] if scenario is not None else 0.0)
    scale = options.bytes_scale if options.bytes_scale is not None else \
        (scenario.bytes_scale_for(trained_params) if scenario is not None else 1.0)
    cpu = pick(options.transfer_cpu_seconds_per_mb, scenario and scenario.cpu_seconds_per_mb, 0.0)
    delays = pick(options.delays_per_phase, scenario and scenario.delays_per_phase, 1.0)
    link = LinkModel(rate_mbit=rate, latency_ms=latency, bytes_scale=scale,
                     ranks_sharing=dims.tp * dims.pp * min(dims.site_sizes), cpu_seconds_per_mb=cpu, delays_per_phase=delays)
    return SimulatedClock(costs, link, streams)


def describe(clock: SimulatedClock, scenario_path: Optional[str], trained_params: int,
             shard_scale: float = 1.0) -> List[str]:
    """Lines for the log: every number the simulated clock uses, and where derived ones came from
    (`shard_scale`: optimizer_shard_scale, which the optimizer step includes)."""
    c, link = clock.costs, clock.link
    lines = [f"> simulated clock{f' (scenario {scenario_path})' if scenario_path else ' (default costs)'}: "
             f"micro-batch {c.microbatch_seconds:.4g} s x site factor {c.factor:g} over {c.pipeline_stages} "
             f"stage(s), optimizer step {c.optimizer_step_seconds:.4g} s"
             + (f" (x {shard_scale:.4g}: this site's ZeRO-1 shard against the smallest site's)"
                if shard_scale != 1.0 else "") + ", intra-site "
             f"{c.intra_site_gbit:g} Gbit/s",
             f"> simulated link of this site: {link.rate_mbit:g} Mbit/s{' (unlimited)' if link.rate_mbit <= 0 else ''} "
             f"shared by {link.ranks_sharing} rank(s), {link.latency_ms:g} ms one way x {link.delays_per_phase:g} per "
             f"phase of a collective, bytes x {link.bytes_scale:.4g} "
             f"({trained_params:,} trained parameters)"
             + (f", {link.cpu_seconds_per_mb:g} s of compute per MB sent" if link.cpu_seconds_per_mb else "")]
    if scenario_path:
        for key, how in load_scenario(scenario_path).derived.items():
            lines.append(f">   {key}: {how}")
    return lines
