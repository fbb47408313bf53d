"""A simulated clock (`--simulate-clock`): virtual time from a cost model, nothing sleeps.

Each rank keeps its own virtual time. What advances it:
- compute, charged from the cost model (`CostModel`): seconds per micro-batch
  forward+backward of one model replica, spread over its pipeline stages with the 1F1B
  bubble ((n + PP - 1) / PP micro-batch times for n micro-batches), a forward-only pass a
  third of that, and seconds per optimizer step; all times this site's compute factor (a
  slow site), and a straggler rank's sleep (--simulate-slow-ranks) is virtual too;
- reductions inside the site, at the intra-site bandwidth (ring: 2 (n-1)/n of the bytes);
  the site's ranks then agree on the latest of their times (the reduction is a barrier);
- inter-site collectives, by the link model (`LinkModel`, `LinkFifo`): a collective
  starts when its last participant issues it and its link is free, and takes latency +
  bytes x bytes-scale / rate, where bytes are what comm.py counts as crossing (ring
  factors included) and rate is this rank's share of its site's link (the site's ranks
  send at once, so each gets rate / ranks-per-site; with sites of different sizes, whose
  lanes pair one rank per site, rate / the smallest site's ranks: scenario.py); the slowest
  participant's link sets
  the duration. The latency is the collective's phases, each a message that must arrive
  before the next is sent (a ring all-reduce over S sites 2 (S - 1), an all-gather S - 1,
  comm.py says which), x `delays_per_phase` one-way delays (1: the data alone; gloo after
  an idle gap takes about 2, a ready notice and the data, which tools/wan/collective_probe.py
  measures); `wait()` advances to the completion; a collective that completed while
  compute ran costs nothing;
- the CPU a transfer takes from the ranks (`LinkModel.cpu_seconds_per_mb`, 0 by default: a
  GPU's NIC moves the bytes by itself): where the network stack shares the ranks' cores (the
  emulated WAN on a small machine), each MB a rank sends costs its timeline that many
  seconds right after the issue: the compute that follows is slower, the transfer is not.

Participants learn each other's issue times from a small MAX all-reduce issued right after
each inter-site collective on the same group, so every rank of the group sees the same
start and end, and two runs with the same flags make the same timing-driven decisions. The
collectives' real duration does not matter: a run takes only its real compute time.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from dataclasses import dataclass
from typing import Deque, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_lsgd.core.clock import Clock, Job

# The version of the cost and link model: a figure made on the simulated clock is comparable
# only with figures of the same version (benchmarks record it with each result and tell
# old ones apart). 1: one one-way delay per collective; 2: latency from the collective's
# phases (`LinkModel.latency_seconds`), and a straggler's sleep leaves its waits out.
CLOCK_MODEL = 2


@dataclass(frozen=True)
class CostModel:
    """This rank's compute costs, in seconds."""

    microbatch_seconds: float = 0.05  # forward+backward of one micro-batch through a whole replica
    optimizer_step_seconds: float = 0.005  # one inner optimizer step of this rank's shard
    intra_site_gbit: float = 100.0  # bandwidth of reductions inside a site (Gbit/s, 0: free)
    pipeline_stages: int = 1
    factor: float = 1.0  # this site's slowdown (a heterogeneous or slow site)

    def compute_seconds(self, microbatches: int, forward_only: bool = False) -> float:
        p = self.pipeline_stages
        seconds = self.microbatch_seconds * (microbatches + p - 1) / p
        return self.factor * (seconds / 3.0 if forward_only else seconds)

    def last_backward_seconds(self) -> float:
        """The backward of one micro-batch on this stage (2/3 of its forward+backward)."""
        return self.factor * self.microbatch_seconds / self.pipeline_stages * 2.0 / 3.0

    def intra_site_seconds(self, nbytes: int, ranks: int) -> float:
        if ranks <= 1 or self.intra_site_gbit <= 0:
            return 0.0
        return 2 * (ranks - 1) / ranks * nbytes * 8 / (self.intra_site_gbit * 1e9)


@dataclass(frozen=True)
class LinkModel:
    """This rank's share of its site's inter-site link."""

    rate_mbit: float = 0.0  # the site's rate (0: unlimited)
    latency_ms: float = 0.0  # one way
    bytes_scale: float = 1.0  # target model parameters / trained parameters
    ranks_sharing: int = 1  # ranks of the site that send at the same time
    cpu_seconds_per_mb: float = 0.0  # compute time a sent MB takes from this rank (the network stack on its cores)
    delays_per_phase: float = 1.0  # one-way delays each phase of a collective costs (see the module docstring)

    def latency_seconds(self, phases: int) -> float:
        """The latency of a collective of `phases` sequential messages."""
        return phases * self.delays_per_phase * self.latency_ms / 1e3

    def serialization_seconds(self, nbytes: int) -> float:
        if self.rate_mbit <= 0:
            return 0.0
        return nbytes * self.bytes_scale * 8 * self.ranks_sharing / (self.rate_mbit * 1e6)

    def cpu_seconds(self, nbytes: int) -> float:
        return nbytes * self.bytes_scale / 1e6 * self.cpu_seconds_per_mb


class LinkFifo:
    """One rank's link, first in first out: a transfer starts once it has been issued by
    every participant and the transfers before it have left the link."""

    def __init__(self):
        self.free_at = 0.0

    def schedule(self, last_issue: float, serialization: float, latency: float) -> float:
        """Returns the completion time; the link is busy until the data has left it."""
        start = max(last_issue, self.free_at)
        self.free_at = start + serialization
        return self.free_at + latency


class SimulatedTransfer:
    """One inter-site collective in virtual time: its completion is known once every
    participant's issue time (and link) has arrived, which `done_at` waits for."""

    def __init__(self, fifo: "TransferLog", agreed: torch.Tensor, work):
        self._log = fifo
        self._agreed = agreed  # [latest issue time, slowest serialization, largest latency]
        self._work = work
        self._done: Optional[float] = None

    def done_at(self) -> float:
        if self._done is None:
            self._log.resolve_through(self)
        return self._done

    def _resolve(self, fifo: LinkFifo) -> None:
        if self._work is not None:
            self._work.wait()
        issue, serialization, latency = (float(x) for x in self._agreed.tolist())
        self._done = fifo.schedule(issue, serialization, latency)


class TransferLog:
    """The transfers issued on one rank's link, resolved strictly in issue order (the FIFO's
    state after transfer k is needed for k+1)."""

    def __init__(self, link: LinkModel):
        self.link = link
        self.fifo = LinkFifo()
        self._pending: Deque[SimulatedTransfer] = deque()
        self._lock = threading.Lock()  # acco/dpu issue from their worker thread

    def issue(self, clock: "SimulatedClock", nbytes: int, group, device: torch.device,
              phases: int = 1) -> SimulatedTransfer:
        """Called right after the collective itself is issued, on the same group (collective);
        `phases`: its sequential messages (comm.py's `phases`)."""
        agreed = torch.tensor([clock.now(), self.link.serialization_seconds(nbytes), self.link.latency_seconds(phases)],
                              dtype=torch.float64, device=device)
        work = dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group, async_op=True) \
            if group is not None and dist.is_initialized() else None
        transfer = SimulatedTransfer(self, agreed, work)
        with self._lock:
            self._pending.append(transfer)
        clock.advance(self.link.cpu_seconds(nbytes))  # after the issue time was taken: it slows what follows
        return transfer

    def resolve_through(self, transfer: SimulatedTransfer) -> None:
        with self._lock:
            while self._pending:
                head = self._pending.popleft()
                head._resolve(self.fifo)
                if head is transfer:
                    return


@dataclass
class _Pass:
    """A forward+backward pass in progress (`SimulatedClock.computing`)."""

    seconds: float  # what the whole pass costs
    last_backward: float  # the last micro-batch's backward, which ends the pass
    done: float = 0.0  # share of that backward reported done
    charged: float = 0.0  # seconds of the pass already charged


class SimulatedClock(Clock):
    """Virtual time (see the module docstring). Threads other than the one that built it
    run on the timeline of the job they are bound to."""

    simulated = True

    def __init__(self, costs: CostModel, link: LinkModel, streams=None):
        self.costs = costs
        self.link = link
        self._main = Job(0.0)
        self._pass: Optional[_Pass] = None
        self._bound = threading.local()
        super().__init__(streams)  # the device's streams order work; they never enter virtual time

    def _timeline(self) -> Job:
        return getattr(self._bound, "job", None) or self._main

    def now(self) -> float:
        return self._timeline().t

    def advance(self, seconds: float) -> None:
        if seconds > 0:
            timeline = self._timeline()
            timeline.advance_to(timeline.t + seconds)

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def wait_until(self, t: float) -> float:
        waited = max(t - self.now(), 0.0)
        self._timeline().advance_to(t)
        return waited

    # moments inside a step are virtual too, on every device
    def mark(self) -> float:
        return self.now()

    def seconds(self, a, b) -> float:
        return b - a

    def marks_complete(self, marks, block: bool) -> bool:
        return True

    # ---- compute ------------------------------------------------------------------------------------
    def compute(self, microbatches: int, forward_only: bool = False) -> None:
        self.advance(self.costs.compute_seconds(microbatches, forward_only))

    @contextlib.contextmanager
    def computing(self, microbatches: int) -> Iterator[None]:
        """Charges the pass when it ends, less what `backward_done` already charged: work a
        unit hook issues mid-backward (dreamddp's layer averages) starts at its place in
        the pass, and a profiler sees each unit's share of the backward, not zeros."""
        self._pass = _Pass(self.costs.compute_seconds(microbatches), self.costs.last_backward_seconds())
        try:
            yield
        finally:
            rest, self._pass = self._pass.seconds - self._pass.charged, None
            self.advance(rest)

    def backward_done(self, share: float) -> None:
        """The last micro-batch's backward ends the pass; it takes 2/3 of a micro-batch on
        this stage and is spread over the units in proportion to the shares they report."""
        if self._pass is None:
            return
        self._pass.done = min(1.0, self._pass.done + share)
        reached = self._pass.seconds - self._pass.last_backward * (1.0 - self._pass.done)
        if reached > self._pass.charged:
            self.advance(reached - self._pass.charged)
            self._pass.charged = reached

    def optimizer_step(self) -> None:
        self.advance(self.costs.factor * self.costs.optimizer_step_seconds)

    def intra_site(self, nbytes: int, ranks: int, site_group, device) -> None:
        self.advance(self.costs.intra_site_seconds(nbytes, ranks))
        if site_group is not None and dist.is_initialized() and dist.get_world_size(site_group) > 1:
            latest = torch.tensor([self.now()], dtype=torch.float64, device=device)
            dist.all_reduce(latest, op=dist.ReduceOp.MAX, group=site_group)
            self.wait_until(float(latest.item()))

    # ---- inter-site transfers ---------------------------------------------------------------------------
    def transfer_log(self) -> TransferLog:
        return TransferLog(self.link)

    # ---- other threads ------------------------------------------------------------------------------------
    def start_job(self) -> Job:
        return Job(self.now())

    def bound(self, job: Job):
        return _Bound(self, job)

    def done_by_now(self, job: Job) -> bool:
        now = self.now()
        job.wait_past(now)  # the answer is known once the job has finished or passed this moment
        return job.finished and job.t <= now

    def join(self, job: Job) -> None:
        self._timeline().advance_to(job.t)


class _Bound:
    def __init__(self, clock: SimulatedClock, job: Job):
        self.clock, self.job = clock, job

    def __enter__(self):
        self.clock._bound.job = self.job

    def __exit__(self, *exc):
        self.clock._bound.job = None
        self.job.finish()
        return False
