"""Device discipline for everything that crosses sites, in one place.

Two devices matter to an inter-site collective:
- the *group's* device: where its backend takes tensors (NCCL: this rank's GPU; gloo: the
  host, `--inter-site-backend gloo`);
- the *run's* device: where the model computes and where synchronizers build their
  payloads (and their small control tensors), never a bare `torch.tensor` on the host.
  With `--lsgd-outer-offload` payloads may also start on the host, where the outer
  arithmetic runs.

`InterSiteDevices.check` rejects a tensor on any other device (a bare host tensor on a GPU
run, the classic "CPU tensor handed to NCCL") with the collective named, before the
backend sees it. A payload on an allowed device that is not the group's own is staged:
`Staging` copies it into a reused buffer on the group's device (pinned host memory for
gloo on a GPU run), runs the collective there and copies the result back when the
collective is waited for (`StagedWork.wait`).

On a GPU the device-to-host copy runs on a stream of its own that first waits for the
producing stream, and the collective is issued once that copy has finished; kernels
already queued on the compute stream keep running meanwhile. The copy back is queued on
the waiting thread's current stream, so every later kernel sees the result.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist


class WrongDevice(RuntimeError):
    """A synchronizer handed an inter-site collective a tensor on a device its group cannot take."""


def choose_inter_site_backend(requested: Optional[str], run_device: torch.device, algorithm: Optional[str] = None,
                              threaded: bool = False) -> str:
    """--inter-site-backend: default nccl on a GPU run, gloo on the host. NCCL needs GPUs.
    `threaded`: the algorithm communicates from a thread of its own (acco/dpu), whose
    groups are gloo so that only the compute thread launches NCCL kernels (their order is
    then fixed by construction, docs/algorithms/acco.md); its inter-site traffic is gloo."""
    if requested is None:
        return "nccl" if run_device.type == "cuda" and not threaded else "gloo"
    if requested not in ("nccl", "gloo"):
        raise ValueError(f"--inter-site-backend {requested!r}: choose nccl or gloo")
    if requested == "nccl" and run_device.type != "cuda":
        raise ValueError(f"--inter-site-backend nccl needs CUDA (this run computes on {run_device}); use gloo")
    if requested == "nccl" and threaded:
        raise ValueError(f"--inter-site-backend nccl: --lsgd-algorithm {algorithm} communicates from a worker "
                         f"thread whose collectives run on gloo groups, so that only the compute thread launches "
                         f"NCCL kernels (docs/algorithms/acco.md); use gloo or drop the flag")
    return requested


def worker_group_backend(run_device: torch.device) -> Optional[str]:
    """The backend of the process groups a worker thread communicates on (acco/dpu): gloo on
    a GPU run (NCCL kernels launched from two threads could wait for each other in an order
    that depends on timing), the world's own on the host (gloo already)."""
    return "gloo" if run_device.type == "cuda" else None


def backend_device(backend: str, run_device: torch.device) -> torch.device:
    """Where a collective on a group of this backend takes its tensors."""
    return torch.device("cpu") if backend == "gloo" else run_device


@dataclass(frozen=True)
class InterSiteDevices:
    group: torch.device  # where the inter-site backend takes tensors
    run: torch.device  # where the model computes: payloads and control tensors start here
    host_payloads: bool = False  # --lsgd-outer-offload: payloads may also start on the host

    @classmethod
    def on(cls, device: torch.device) -> "InterSiteDevices":
        """Everything on one device (a CPU run, or tests)."""
        return cls(group=device, run=device)

    def allowed(self, device: torch.device) -> bool:
        return _same(device, self.group) or _same(device, self.run) or (self.host_payloads and device.type == "cpu")

    def check(self, what: str, tensor: torch.Tensor) -> None:
        if not self.allowed(tensor.device):
            raise WrongDevice(f"{what}: a tensor on {tensor.device} for an inter-site group on {self.group} "
                              f"(the run computes on {self.run}{', outer state on the host' if self.host_payloads else ''})"
                              f"; build it on the run's device")

    def needs_staging(self, tensor: torch.Tensor) -> bool:
        return not _same(tensor.device, self.group)

    def all_reduce(self, what: str, tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
        """A blocking all-reduce of a few control values (the training loop's log-line means
        and sample sums) on an inter-site group: checked like every inter-site collective,
        and copied through the group's device when the tensor lives elsewhere (a few bytes:
        a plain copy, no staging pool)."""
        self.check(what, tensor)
        if not self.needs_staging(tensor):
            dist.all_reduce(tensor, op=op, group=group)
            return
        staged = tensor.to(self.group)
        dist.all_reduce(staged, op=op, group=group)
        tensor.copy_(staged)


def _same(a: torch.device, b: torch.device) -> bool:
    # "cuda" and "cuda:0" name the same device once the process has set its device.
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index is None or b.index is None:
        return True
    return a.index == b.index


class StagedWork:
    """A collective run on staged copies: `wait` waits for it, then copies each result back."""

    def __init__(self, work, landings: List[Tuple[torch.Tensor, torch.Tensor]], staging: "Staging"):
        self._work = work
        self._landings = landings  # (destination on the payload's device, staged buffer)
        self._staging = staging

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def wait(self) -> None:
        self._work.wait()
        if self._landings is None:
            return
        for dst, buf in self._landings:
            dst.copy_(buf.view_as(dst), non_blocking=buf.is_pinned())
        released = [buf for _, buf in self._landings]
        self._landings = None
        self._staging.release(released, after_current_stream=True)


class Staging:
    """Buffers on the group's device for payloads that live elsewhere, reused by size."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pin = device.type == "cpu" and torch.cuda.is_available()
        self._free: Dict[Tuple[int, torch.dtype], List[torch.Tensor]] = {}
        self._ready: Dict[int, object] = {}  # id(buffer) -> CUDA event after its last copy back
        self._lock = threading.Lock()  # ACCO/DPU's worker thread stages beside the main thread
        self._stream = None
        self.allocated = 0  # buffers ever made (reuse keeps this flat)

    def _take(self, like: torch.Tensor) -> torch.Tensor:
        key = (like.numel(), like.dtype)
        with self._lock:
            pool = self._free.get(key)
            if pool:
                return pool.pop()
            self.allocated += 1
        return torch.empty(like.numel(), dtype=like.dtype, device=self.device, pin_memory=self.pin)

    def release(self, bufs: List[torch.Tensor], after_current_stream: bool = False) -> None:
        with self._lock:
            for buf in bufs:
                if after_current_stream and torch.cuda.is_available():
                    event = torch.cuda.Event()
                    event.record()  # the copy back out of this buffer is queued before it
                    self._ready[id(buf)] = event
                self._free.setdefault((buf.numel(), buf.dtype), []).append(buf)

    def stage_in(self, tensors: List[torch.Tensor], fill: List[bool]) -> List[torch.Tensor]:
        """A staged buffer per tensor; those with `fill` get the tensor's values (inputs)."""
        bufs = [self._take(t) for t in tensors]
        for buf in bufs:  # a reused buffer may still be read by its previous copy back
            with self._lock:
                event = self._ready.pop(id(buf), None)
            if event is not None:
                if buf.is_cuda:
                    torch.cuda.current_stream().wait_event(event)
                else:
                    event.synchronize()
        if any(f and t.is_cuda for t, f in zip(tensors, fill)) or any(b.is_cuda for b in bufs):
            self._copy_on_side_stream(tensors, bufs, fill)
        else:
            for t, buf, f in zip(tensors, bufs, fill):
                if f:
                    buf.copy_(t.reshape(-1))
        return bufs

    def _copy_on_side_stream(self, tensors, bufs, fill) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        producer = torch.cuda.current_stream()
        with torch.cuda.stream(self._stream):
            self._stream.wait_stream(producer)  # the payload is written by queued kernels
            for t, buf, f in zip(tensors, bufs, fill):
                if f:
                    buf.copy_(t.reshape(-1), non_blocking=True)
                    if t.is_cuda:
                        t.record_stream(self._stream)  # read here, whatever the producer does next
            done = torch.cuda.Event()
            done.record()
        if any(not b.is_cuda for b in bufs):
            done.synchronize()  # gloo reads host buffers as soon as it is called: wait for the copies only
        else:
            producer.wait_event(done)  # NCCL orders itself after the caller's stream

    def land(self, work, pairs: List[Tuple[torch.Tensor, torch.Tensor]], inputs: List[torch.Tensor]) -> StagedWork:
        """`work` writes the staged buffers of `pairs` (destination, buffer); the buffers in
        `inputs` (read-only for the collective) are free once it completes."""
        return StagedWork(_ReleaseInputs(work, inputs, self), pairs, self)


class _ReleaseInputs:
    """Returns input-only staged buffers to the pool once the collective has completed."""

    def __init__(self, work, inputs: List[torch.Tensor], staging: Staging):
        self._work, self._inputs, self._staging = work, inputs, staging

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def wait(self) -> None:
        self._work.wait()
        if self._inputs:
            self._staging.release(self._inputs)
            self._inputs = []
