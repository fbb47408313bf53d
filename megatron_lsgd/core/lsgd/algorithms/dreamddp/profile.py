"""DreamDDP's profiler: per-unit backward time b_l and cross-site averaging time c_l.

- Backward times come from real training steps: the unit hooks (`after_unit_backward`)
  give the moment each unit's backward completed in the last micro-batch; b_l is the gap
  to the previous unit in backward order. The first unit's backward starts when the
  gradient of its output arrives, caught by a tensor hook on that output while profiling.
  `tail` is the time from the last unit's completion to the wait before the optimizer
  step (the intra-site reduce). The moments are the run clock's marks (core/clock.py):
  events queued on the current stream on a GPU (read after the step), the present on CPU.
- Averaging times come from a fit c(bytes) = latency + bytes x seconds_per_byte of timed
  blocking all-reduces ("probes") over this rank's dp_inter group, through the inter-site
  comm (so a simulated link is measured like a real one). A unit issues one all-reduce
  per contiguous range of its ZeRO-1 slices: c_l = ranges x latency + bytes x slope.
- Sites and ranks measure different times; the schedule must not differ. Every value is
  agreed as the maximum over all ranks of the job (a MAX all-reduce inside the site, then
  across sites), and the schedule of every stage is computed from the agreed profile on
  every rank.

The agreed profile and the schedule are written as JSON (`write_json`) next to the logs;
`--lsgd-dreamddp-profile FILE` reads one back (backward times, tails and the link fit;
sizes are re-measured from the running model).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron_lsgd.core.lsgd.agreement import agree_max_in_job
from megatron_lsgd.core.lsgd.algorithms.dreamddp.scheduler import Problem

PROFILE_FORMAT = "megatron_lsgd.dreamddp.profile/1"


# ---- unit names <-> global positions ---------------------------------------------------------
def global_index(name: str, num_layers: int) -> int:
    """embedding -> 0, layers.i -> 1 + i, output -> num_layers + 1."""
    if name == "embedding":
        return 0
    if name == "output":
        return num_layers + 1
    if name.startswith("layers."):
        return 1 + int(name.split(".", 1)[1])
    raise ValueError(f"unknown sync unit {name!r}")


def global_name(index: int, num_layers: int) -> str:
    if index == 0:
        return "embedding"
    if index == num_layers + 1:
        return "output"
    return f"layers.{index - 1}"


def stage_of(index: int, num_layers: int, num_stages: int) -> int:
    if index == 0:
        return 0
    if index == num_layers + 1:
        return num_stages - 1
    return (index - 1) // (num_layers // num_stages)


# ---- the agreed profile --------------------------------------------------------------------
@dataclass
class UnitProfile:
    name: str
    stage: int
    backward_s: float  # b: backward time of the unit in the last micro-batch
    bytes: int  # fp32 payload of the largest slice any rank averages
    collectives: int  # all-reduces per averaging (contiguous ranges), the most of any rank


@dataclass
class Profile:
    """The profile every rank agrees on: units in forward order over all stages."""

    units: List[UnitProfile]
    tails_s: List[float]  # per stage
    latency_s: float
    seconds_per_byte: float
    tied_embeddings: bool  # PP > 1 with tied word embeddings: first and last stage hold copies
    source: str = "measured"  # or the JSON it was read from
    measured_steps: List[int] = field(default_factory=list)  # iterations whose timings were used

    @property
    def num_stages(self) -> int:
        return len(self.tails_s)

    def comm_s(self, u: UnitProfile) -> float:
        return u.collectives * self.latency_s + u.bytes * self.seconds_per_byte if u.collectives else 0.0

    def stage_units(self, stage: int) -> List[UnitProfile]:
        """The stage's units in backward order (the output head first)."""
        return [u for u in reversed(self.units) if u.stage == stage]

    def problem(self, stage: int) -> Problem:
        units = self.stage_units(stage)
        return Problem(tuple(u.backward_s for u in units), tuple(self.comm_s(u) for u in units),
                       self.tails_s[stage], tuple(u.name for u in units))

    def to_dict(self) -> Dict:
        return {"format": PROFILE_FORMAT, "source": self.source, "measured_steps": list(self.measured_steps),
                "link": {"latency_ms": 1e3 * self.latency_s, "ms_per_MB": 1e3 * self.seconds_per_byte * 2**20},
                "tied_embeddings": self.tied_embeddings,
                "stages": [{"stage": s, "tail_ms": 1e3 * t} for s, t in enumerate(self.tails_s)],
                "units": [{"name": u.name, "stage": u.stage, "backward_ms": 1e3 * u.backward_s, "bytes": u.bytes,
                           "collectives": u.collectives, "comm_ms": 1e3 * self.comm_s(u)} for u in self.units]}


def read_profile_file(path: str, flag: str = "--lsgd-dreamddp-profile") -> Dict:
    """The parts of a profile JSON a run takes from it; ValueError naming the flag."""
    try:
        with open(path) as f:
            d = json.load(f)
    except OSError as err:
        raise ValueError(f"{flag} {path}: cannot read it ({err.strerror or err})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{flag} {path}: not JSON ({err})") from None
    profile = d.get("profile", d) if isinstance(d, dict) else None
    try:
        assert profile["format"] == PROFILE_FORMAT
        backward = {u["name"]: float(u["backward_ms"]) for u in profile["units"]}
        tails = [float(s["tail_ms"]) for s in profile["stages"]]
        latency, slope = float(profile["link"]["latency_ms"]), float(profile["link"]["ms_per_MB"])
    except (AssertionError, KeyError, TypeError, ValueError):
        raise ValueError(f"{flag} {path}: not a dreamddp profile (write one with a profiling run: it is saved as "
                         f"dreamddp_profile.json next to --json-log / --tensorboard-dir / --save)") from None
    values = list(backward.values()) + tails + [latency, slope]
    if not all(math.isfinite(v) and v >= 0 for v in values):
        raise ValueError(f"{flag} {path}: times must be finite and >= 0")
    return {"backward_ms": backward, "tails_ms": tails, "latency_ms": latency, "ms_per_MB": slope}


# ---- timing inside steps ----------------------------------------------------------------------
START, WAIT = "<backward start>", "<wait>"


class BackwardRecorder:
    """Records when each unit's backward completes (and, while `armed`, when the first
    unit's backward starts) during one step; `sample()` turns the marks into times."""

    def __init__(self, backward_names: Sequence[str], clock, first_module: Optional[torch.nn.Module]):
        self.names = list(backward_names)
        self.clock = clock
        self.first_module = first_module
        self.marks: Dict[str, object] = {}
        self._handle = None

    def arm(self) -> None:
        """Catch the start of the first unit's backward (a tensor hook on its output)."""
        if self._handle is not None or self.first_module is None:
            return

        def on_output(_module, _inputs, output):
            if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(self._backward_started)

        self._handle = self.first_module.register_forward_hook(on_output)

    def disarm(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _backward_started(self, _grad):
        self.marks[START] = self.clock.mark()  # the last micro-batch's backward writes last

    def begin_step(self) -> None:
        self.marks = {}

    def unit_done(self, name: str) -> None:
        self.marks[name] = self.clock.mark()

    def wait_reached(self) -> None:
        self.marks[WAIT] = self.clock.mark()

    def sample(self, block: bool) -> Optional[Dict[str, object]]:
        """{"backward": {name: s}, "tail": s}, or None when a unit did not report (or, with
        block=False on GPU, when the events have not completed yet)."""
        marks = dict(self.marks)
        if any(n not in marks for n in self.names) or WAIT not in marks:
            return None
        if not self.clock.marks_complete(marks.values(), block):
            return None
        backward: Dict[str, float] = {}
        previous = marks.get(START)
        for n in self.names:
            backward[n] = max(0.0, self.clock.seconds(previous, marks[n])) if previous is not None else float("nan")
            previous = marks[n]
        return {"backward": backward, "tail": max(0.0, self.clock.seconds(marks[self.names[-1]], marks[WAIT]))}


def fastest_sample(samples: List[Dict[str, object]], names: Sequence[str]) -> Tuple[Dict[str, float], float]:
    """Per-unit fastest backward time and fastest tail over the steps (NaNs, i.e. an unseen
    start, are skipped; none left: 0). The fastest, not the median: on a shared machine
    transient load only ever slows a step down, and a profile that overstates the backward
    would schedule averages (bubble filling above all) that do not hide; one that
    understates it only misses some hiding."""
    backward = {}
    for n in names:
        values = [s["backward"][n] for s in samples if not math.isnan(s["backward"][n])]
        backward[n] = min(values) if values else 0.0
    return backward, min(s["tail"] for s in samples) if samples else 0.0


# ---- the link ---------------------------------------------------------------------------------
def probe_sizes(max_bytes: int) -> List[int]:
    """Payloads (bytes, multiples of 4) for the link fit: a small one for the latency, the
    largest unit (capped at 4 MiB, enough to see the slope) and their geometric middle."""
    small = 4096
    large = max(16 * small, min(max(max_bytes, 4), 4 * 2**20))
    middle = int(math.sqrt(small * large))
    return sorted({small, 4 * (middle // 4), 4 * (large // 4)})


def probe_link(comm, max_bytes: int, device: torch.device, repeats: int = 2) -> List[Tuple[int, float]]:
    """Timed blocking all-reduces over dp_inter: [(payload bytes, best seconds)] per size.
    Collective: every rank of the dp_inter group calls it with the same `max_bytes`."""
    sizes = probe_sizes(max_bytes)
    buf = torch.zeros(max(sizes) // 4, dtype=torch.float32, device=device)
    clock = comm.clock  # device-synchronised readings (core/clock.py)
    comm.all_reduce_mean(buf[:1])  # connection set-up is not the link
    best = {n: math.inf for n in sizes}
    for _ in range(repeats):
        for n in sizes:
            t0 = clock.now()
            comm.all_reduce_mean(buf[:n // 4])
            best[n] = min(best[n], clock.now() - t0)
    return [(n, best[n]) for n in sizes]


def fit_link(samples: Sequence[Tuple[int, float]]) -> Tuple[float, float]:
    """Least-squares latency + bytes x slope, both kept >= 0."""
    if not samples:
        return 0.0, 0.0
    xs = [float(x) for x, _ in samples]
    ys = [float(y) for _, y in samples]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    latency = my - slope * mx
    if slope < 0:
        return max(0.0, my), 0.0
    if latency < 0:  # through the origin
        return 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return latency, slope


# ---- agreement ----------------------------------------------------------------------------------
def agree_max(values: List[float], pgs, comm, device: torch.device) -> List[float]:
    """Element-wise maximum over every rank of the job: inside the site, then across sites
    (every rank of a site holds the site's maximum, so dp_inter completes it)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    agree_max_in_job(t, pgs, comm)
    return [float(x) for x in t.cpu().tolist()]


@dataclass
class LocalMeasurement:
    """What one rank contributes to the agreed profile."""

    backward_s: Dict[str, float]  # this stage's units
    bytes: Dict[str, int]
    collectives: Dict[str, int]
    tail_s: float
    latency_s: float
    seconds_per_byte: float
    tied: bool


def agree_profile(local: LocalMeasurement, stage: int, num_stages: int, num_layers: int, pgs, comm,
                  device: torch.device) -> Profile:
    G = num_layers + 2
    vec = [0.0] * (4 * G + num_stages + 3)
    for name, b in local.backward_s.items():
        i = global_index(name, num_layers)
        vec[i], vec[G + i], vec[2 * G + i], vec[3 * G + i] = b, local.bytes[name], local.collectives[name], 1.0
    vec[4 * G + stage] = local.tail_s
    vec[4 * G + num_stages:] = [local.latency_s, local.seconds_per_byte, 1.0 if local.tied else 0.0]
    out = agree_max(vec, pgs, comm, device)
    units = [UnitProfile(global_name(i, num_layers), stage_of(i, num_layers, num_stages), out[i], int(out[G + i]),
                         int(out[2 * G + i])) for i in range(G) if out[3 * G + i] > 0]
    latency, slope, tied = out[4 * G + num_stages:]
    return Profile(units, out[4 * G:4 * G + num_stages], latency, slope, tied > 0)
