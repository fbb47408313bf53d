"""Inter-site collectives over the dp_inter group, with accounting.

Bytes are counted where each collective is issued, as what this rank puts on (and takes
off) the wire for the algorithm used: ring all-reduce 2 (S-1)/S of the payload, ring
all-gather (S-1)/S of the output, all-to-all (S-1)/S of the input. Time spent *waiting*
for inter-site work is accumulated as exposed communication: a collective that finished
while compute ran costs nothing here.

An optional simulated slow link (latency + bandwidth, for tests and benchmarks without
`tc`) makes each collective complete no earlier than its simulated finish time. The link
is a FIFO: a transfer starts when the previous one on this rank's link has finished, and
takes latency + bytes_sent * 8 / bandwidth. The deadline is fixed when the collective is
issued, so compute that runs meanwhile really hides it.

Time comes from the run's clock (core/clock.py): real time by default, where the simulated
slow link above sleeps; or a simulated clock, under which the link is a model of virtual
time (core/simulation.py) and nothing sleeps.

A synchronizer that communicates on a thread of its own (ACCO/DPU) wraps that thread's work
in `overlapped()`: waits on that thread then do not count as exposed (nothing waits for
them but the thread itself); the synchronizer adds the time its compute thread spends
waiting for the other thread with `record_exposed_between`. The bytes and rounds of that work go
to the `Tally` it yields and join the totals when the compute thread `settle`s it (after
waiting for the job), so the totals a log line reads do not depend on how far the other
thread happened to be.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_lsgd.core.clock import Clock
from megatron_lsgd.core.distributed.collectives import all_gather_flat
from megatron_lsgd.core.lsgd.devices import InterSiteDevices, Staging


@dataclass
class SimulatedLink:
    latency_ms: float = 0.0
    bandwidth_mbit: float = 0.0  # 0: unlimited

    @property
    def enabled(self) -> bool:
        return self.latency_ms > 0 or self.bandwidth_mbit > 0

    def transfer_seconds(self, nbytes: int) -> float:
        seconds = self.latency_ms / 1e3
        if self.bandwidth_mbit > 0:
            seconds += nbytes * 8 / (self.bandwidth_mbit * 1e6)
        return seconds


@dataclass
class Tally:
    """Bytes and rounds of work done on another thread, until the caller settles them."""

    bytes_sent: int = 0
    bytes_received: int = 0
    rounds: int = 0


class InterSiteTimeout(RuntimeError):
    """A rank gives up on the other sites (a collective past its timeout, a floor of sites
    not met, rounds that keep failing): the run's one error line and exit code 2."""


class InterSiteWork:
    def __init__(self, comm: "InterSiteComm", work: Optional[object], ready_at: float = 0.0, transfer=None):
        self._comm = comm
        self._work = work
        self._ready_at = ready_at  # simulated-link completion time (the run's clock)
        self._transfer = transfer  # under a simulated clock: the collective in virtual time

    def _completion(self) -> float:
        return self._transfer.done_at() if self._transfer is not None else self._ready_at

    def is_completed(self) -> bool:
        if self._work is None:
            return True
        if self._transfer is not None:  # virtual time decides, the same way on every run
            return self._transfer.done_at() <= self._comm.clock.now()
        # (the clock is read only for a simulated link: on a GPU reading it drains the stream)
        if self._ready_at > 0 and self._comm.clock.now() < self._ready_at:
            return False
        return self._work.is_completed()

    def wait(self) -> None:
        if self._work is None:
            return
        clock = self._comm.clock
        # marks, not readings: on a GPU they time the compute stream's wait without draining it
        # (none on a communication thread, whose waits are not exposed)
        exposed = self._comm.waits_are_exposed()
        start = clock.mark() if exposed else None
        real_t0 = time.perf_counter()  # the transport's timeout is real time, whatever the run's clock
        try:
            self._work.wait()
        except RuntimeError as err:  # gloo/nccl timeout or a peer that closed its connection
            c = self._comm
            cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise InterSiteTimeout(
                f"rank {c.rank} (site {c.site}): an inter-site collective failed after "
                f"{time.perf_counter() - real_t0:.1f} s of waiting (the limit is --distributed-timeout-minutes "
                f"{c.timeout_minutes}): a peer site stopped or its network failed; its own log says why "
                f"[{cause}]") from err
        if self._transfer is not None or self._ready_at > 0:  # a simulated link's time
            clock.wait_until(self._completion())
        if exposed:
            end = clock.mark()
            self._comm.record_exposed_between(start, end)
            clock.record_wait(start, end)  # a straggler's slowdown leaves it out (training/stragglers.py)
        self._work = None


class InterSiteComm:
    def __init__(self, group, num_sites: int, link: Optional[SimulatedLink] = None,
                 timeout_minutes: Optional[float] = None, rank: Optional[int] = None, site: Optional[int] = None,
                 devices: Optional[InterSiteDevices] = None, clock: Optional[Clock] = None,
                 site_weight: Optional[float] = None):
        self.group = group
        # This site's weight in every mean across sites: its share of the round's tokens when
        # sites differ in size (--site-data-parallel-sizes); None: 1 / S, the plain mean.
        self.site_weight = site_weight
        self.clock = clock or Clock()
        # Where payloads may live and where the group takes them (devices.py); default: the host.
        self.devices = devices or InterSiteDevices.on(torch.device("cpu"))
        self.staging = Staging(self.devices.group)
        self.num_sites = num_sites
        self.rank, self.site = rank, site  # named in error messages
        self.link = link or SimulatedLink()
        self.timeout_minutes = timeout_minutes
        self.bytes_sent = 0
        self.bytes_received = 0
        self.exposed_seconds = 0.0
        self._exposed_marks = []  # (a, b) clock marks not read yet (record_exposed_between)
        self.rounds = 0
        self._link_free_at = 0.0
        self._transfers = self.clock.transfer_log()
        self._thread = threading.local()

    # ---- accounting ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def overlapped(self):
        """On this thread, waiting for a collective is not exposed time, and bytes and rounds
        go to the yielded Tally (a communication thread running beside the compute; see the
        module docstring)."""
        previous = getattr(self._thread, "tally", None)
        tally = Tally()
        self._thread.tally = tally
        try:
            yield tally
        finally:
            self._thread.tally = previous

    def waits_are_exposed(self) -> bool:
        return getattr(self._thread, "tally", None) is None

    def settle(self, tally: Tally) -> None:
        """Add another thread's finished work to the totals."""
        self.bytes_sent += tally.bytes_sent
        self.bytes_received += tally.bytes_received
        self.rounds += tally.rounds

    def count_round(self) -> None:
        tally = getattr(self._thread, "tally", None)
        if tally is not None:
            tally.rounds += 1
        else:
            self.rounds += 1

    def record_exposed_between(self, a, b) -> None:
        """The compute thread waited for communication running elsewhere from clock mark a
        to mark b. On a GPU the marks are events on the compute stream (what it waited for
        is the stream waiting on another stream's event), read once they have completed:
        here if they have, else at the next `snapshot`, so counting costs no device sync."""
        if self.clock.marks_complete([a, b], block=False):
            self.exposed_seconds += self.clock.seconds(a, b)
        else:
            self._exposed_marks.append((a, b))

    def _settle_exposed_marks(self) -> None:
        if self._exposed_marks:
            self.clock.marks_complete([m for pair in self._exposed_marks for m in pair], block=True)
            for a, b in self._exposed_marks:
                self.exposed_seconds += self.clock.seconds(a, b)
            self._exposed_marks = []

    def _issue(self, work, sent: int, received: int, phases: int) -> InterSiteWork:
        counts = getattr(self._thread, "tally", None) or self
        counts.bytes_sent += sent
        counts.bytes_received += received
        if self._transfers is not None:  # virtual time: the link model, nothing sleeps
            return InterSiteWork(self, work, transfer=self._transfers.issue(self.clock, sent, self.group,
                                                                            self.devices.group, phases))
        ready_at = 0.0
        if self.link.enabled:
            start = max(self.clock.now(), self._link_free_at)
            ready_at = start + self.link.transfer_seconds(sent)
            self._link_free_at = ready_at
        return InterSiteWork(self, work, ready_at)

    @staticmethod
    def _finish(handle: InterSiteWork, async_op: bool) -> InterSiteWork:
        if not async_op:
            handle.wait()
        return handle

    def phases(self, collective: str) -> int:
        """Sequential messages of a collective across the sites, each waiting for the one before
        (the simulated link charges a latency per phase): a ring all-reduce is a reduce-scatter
        and an all-gather of S - 1 steps each, a ring all-gather S - 1 steps, an all-to-all
        one exchange with every other site at once."""
        steps = self.num_sites - 1
        return {"all_reduce": 2 * steps, "all_gather": steps, "all_to_all": 1}[collective]

    def _ring_bytes(self, nbytes: int) -> int:
        # Ring all-reduce: each rank sends (and receives) 2 (S-1)/S of the payload.
        return 2 * (self.num_sites - 1) * nbytes // self.num_sites

    # ---- collectives -------------------------------------------------------------------------
    def _launch(self, what: str, collective, output: torch.Tensor, tensor: Optional[torch.Tensor] = None):
        """collective(output, tensor) on the group's device (`tensor` None: in place on
        `output`): every tensor is checked, and staged when it lives elsewhere (devices.py)."""
        devices = self.devices
        for t in (output, tensor):
            if t is not None:
                devices.check(what, t)
        stage_out = devices.needs_staging(output)
        stage_in = tensor is not None and devices.needs_staging(tensor)
        if not (stage_out or stage_in):
            return collective(output, tensor)
        if tensor is None:  # in place: one staged buffer, filled and copied back
            (buf,) = self.staging.stage_in([output], [True])
            return self.staging.land(collective(buf, None), [(output, buf)], [])
        out_buf = self.staging.stage_in([output], [False])[0] if stage_out else output
        in_buf = self.staging.stage_in([tensor], [True])[0] if stage_in else tensor
        work = collective(out_buf, in_buf)
        return self.staging.land(work, [(output, out_buf)] if stage_out else [], [in_buf] if stage_in else [])

    @contextlib.contextmanager
    def on_group(self, group):
        """Collectives issued inside the block go to `group` (one lane's dp_inter when sites
        differ in size: parallel_state; None: this comm's own), counted, timed and checked as
        any other. The group is read when a collective is issued, so a handle may be waited
        for after the block."""
        previous = self.group
        if group is not None:
            self.group = group
        try:
            yield self
        finally:
            self.group = previous

    def all_reduce_mean(self, tensor: torch.Tensor, async_op: bool = False) -> InterSiteWork:
        """Average `tensor` across sites in place (scaled first: gloo has no AVG); with
        `site_weight`, the weighted mean: each site scales by its own weight, then a sum."""
        if self.num_sites == 1:
            return InterSiteWork(self, None)
        tensor.mul_(1.0 / self.num_sites if self.site_weight is None else self.site_weight)
        moved = self._ring_bytes(tensor.numel() * tensor.element_size())
        work = self._launch("all_reduce_mean", lambda out, _: dist.all_reduce(out, group=self.group, async_op=True),
                            tensor)
        return self._finish(self._issue(work, moved, moved, self.phases("all_reduce")), async_op)

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False) -> InterSiteWork:
        """output[s * n:(s + 1) * n] = site s's `tensor` (flat, equal sizes)."""
        if self.num_sites == 1:
            output.copy_(tensor.reshape(-1))
            return InterSiteWork(self, None)
        moved = (self.num_sites - 1) * tensor.numel() * tensor.element_size()
        work = self._launch("all_gather", lambda out, inp: all_gather_flat(out, inp, group=self.group, async_op=True),
                            output, tensor)
        return self._finish(self._issue(work, moved, moved, self.phases("all_gather")), async_op)

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False) -> InterSiteWork:
        """Chunk s of `tensor` goes to site s; chunk s of `output` comes from site s."""
        if self.num_sites == 1:
            output.copy_(tensor)
            return InterSiteWork(self, None)
        moved = (self.num_sites - 1) * tensor.numel() * tensor.element_size() // self.num_sites
        work = self._launch("all_to_all", lambda out, inp: dist.all_to_all_single(out, inp, group=self.group,
                                                                                  async_op=True), output, tensor)
        return self._finish(self._issue(work, moved, moved, self.phases("all_to_all")), async_op)

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        """Blocking element-wise max across sites (small control values)."""
        if self.num_sites == 1:
            return
        moved = self._ring_bytes(tensor.numel() * tensor.element_size())
        work = self._launch("all_reduce_max", lambda out, _: dist.all_reduce(out, op=dist.ReduceOp.MAX,
                                                                             group=self.group, async_op=True), tensor)
        self._issue(work, moved, moved, self.phases("all_reduce")).wait()

    def group_timeout(self) -> Optional[timedelta]:
        """The timeout of groups made for this comm's work (--distributed-timeout-minutes;
        None: the default process group's)."""
        return timedelta(minutes=self.timeout_minutes) if self.timeout_minutes else None

    def use_dedicated_group(self, dims) -> List:
        """Move this comm onto a fresh dp_inter group of its own, with its timeout
        (`group_timeout`; collective: every rank calls it). Needed when a synchronizer advances multi-phase reductions between
        steps: each site may issue its next phase at a different step, and collectives
        on a shared group (e.g. the Trainer's log-line mean over dp_inter) would then be
        matched out of order. On a private group only the synchronizer issues, in a fixed
        order on every site. Returns the fresh groups this rank is in, in lane order (one
        per lane it holds, as `ProcessGroups.inter_lanes`; the comm takes the first, as
        `ProcessGroups.dp_inter` is the first lane's)."""
        if self.num_sites == 1 or not dist.is_initialized():
            return []
        from megatron_lsgd.core.parallel_state import enumerate_group_ranks

        timeout = self.group_timeout()
        kwargs = {"timeout": timeout} if timeout is not None else {}
        kwargs["backend"] = dist.get_backend(self.group)  # the same backend as the shared dp_inter
        me, mine = dist.get_rank(), []
        for ranks in enumerate_group_ranks(dims)["dp_inter"]:
            group = dist.new_group(list(ranks), **kwargs)
            if me in ranks:
                mine.append(group)
        self.group = mine[0]
        return mine

    def snapshot(self) -> Dict[str, float]:
        self._settle_exposed_marks()
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "exposed_seconds": self.exposed_seconds, "rounds": self.rounds}
