"""Inter-site collectives over the dp_inter group, with accounting.

Bytes are counted where each collective is issued (per rank, what it sends and receives
on the wire for a ring all-reduce), and time spent *waiting* for inter-site work is
accumulated as exposed communication: a collective that finished while compute ran
costs nothing here.
"""

from __future__ import annotations

import time
from typing import Dict, Optional

import torch
import torch.distributed as dist


class InterSiteWork:
    def __init__(self, comm: "InterSiteComm", work: Optional[object]):
        self._comm = comm
        self._work = work

    def wait(self) -> None:
        if self._work is None:
            return
        t0 = time.perf_counter()
        self._work.wait()
        self._comm.exposed_seconds += time.perf_counter() - t0
        self._work = None


class InterSiteComm:
    def __init__(self, group, num_sites: int):
        self.group = group
        self.num_sites = num_sites
        self.bytes_sent = 0
        self.bytes_received = 0
        self.exposed_seconds = 0.0
        self.rounds = 0

    def _ring_bytes(self, nbytes: int) -> int:
        # Ring all-reduce: each rank sends (and receives) 2 (S-1)/S of the payload.
        return 2 * (self.num_sites - 1) * nbytes // self.num_sites

    def all_reduce_mean(self, tensor: torch.Tensor, async_op: bool = False) -> InterSiteWork:
        """Average `tensor` across sites in place (scaled first: gloo has no AVG)."""
        if self.num_sites == 1:
            return InterSiteWork(self, None)
        tensor.mul_(1.0 / self.num_sites)
        moved = self._ring_bytes(tensor.numel() * tensor.element_size())
        self.bytes_sent += moved
        self.bytes_received += moved
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        handle = InterSiteWork(self, work)
        if not async_op:
            handle.wait()
        return handle

    def snapshot(self) -> Dict[str, float]:
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "exposed_seconds": self.exposed_seconds, "rounds": self.rounds}
