"""ElasticComm on a device (NCCL) group: host payloads (--lsgd-outer-offload) are staged onto
the group's device by InterSiteComm's own path (devices.Staging) and land back in the host
tensors when waited for; on a host (gloo) group the tensors go as they are. No torchft and
no GPU: a recording group stands in for torchft's, and host buffers for the GPU's."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.distributed_c10d import ReduceOp

from megatron_lsgd.core.lsgd.devices import InterSiteDevices, Staging, WrongDevice
from megatron_lsgd.core.lsgd.fault_tolerance.elastic_comm import ElasticComm

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)  # GPU is only declared, never allocated on


class _Work:
    """A collective in flight: its result appears when it is waited for."""

    def __init__(self, log, finish):
        self.log, self.finish, self.done = log, finish, False

    def is_completed(self):
        return self.done

    def wait(self):
        self.log.append(("wait",))
        self.finish()
        self.done = True


class _Group:
    """torchft's group as ElasticComm calls it, for two sites whose peer sends what this one
    does; it records the tensors it is handed (their storage and values when issued)."""

    def __init__(self, log):
        self.log = log

    def allreduce(self, tensors, opts):
        (t,) = tensors
        self.log.append(("allreduce", t.data_ptr(), t.tolist()))
        return _Work(self.log, lambda: t.mul_(2) if opts.reduceOp == ReduceOp.SUM else None)

    def allgather(self, outputs, inputs, opts):
        (parts,), (t,) = outputs, inputs
        self.log.append(("allgather", parts[0].data_ptr(), t.data_ptr(), t.tolist()))
        return _Work(self.log, lambda: [p.copy_(t) for p in parts])

    def alltoall_base(self, output, tensor, out_splits, in_splits, opts):
        self.log.append(("alltoall", output.data_ptr(), tensor.data_ptr(), tensor.tolist()))
        return _Work(self.log, lambda: output.copy_(tensor))  # the peer's chunk equals ours


def _comm(devices, log):
    comm = ElasticComm(2, devices=devices)
    if devices.group.type != "cpu":
        comm.staging = Staging(CPU)  # host buffers stand in for the GPU's (this machine has none)
    stage_in = comm.staging.stage_in

    def recorded(tensors, fill):
        log.append(("stage_in", [t.data_ptr() for t in tensors], fill))
        return stage_in(tensors, fill)

    comm.staging.stage_in = recorded
    comm.set_sites(_Group(log), 2)
    return comm


def test_host_payloads_are_staged_for_a_device_group_and_land_back_when_waited_for():
    log = []
    comm = _comm(InterSiteDevices(group=GPU, run=GPU, host_payloads=True), log)  # NCCL, outer state on the host

    x = torch.arange(4.0)
    work = comm.all_reduce_mean(x, async_op=True)
    assert [e[0] for e in log] == ["stage_in", "allreduce"]
    assert log[0][1:] == ([x.data_ptr()], [True])  # the payload is copied in ...
    _, handed, values = log[1]
    assert handed != x.data_ptr() and values == [0.0, 0.5, 1.0, 1.5]  # ... and the group gets the copy of x / 2
    assert x.tolist() == [0.0, 0.5, 1.0, 1.5]  # not the result until waited for
    work.wait()
    assert [e[0] for e in log] == ["stage_in", "allreduce", "wait"] and x.tolist() == [0.0, 1.0, 2.0, 3.0]

    log.clear()
    out = torch.full((8,), -1.0)
    work = comm.all_gather(out, x, async_op=True)
    assert [e[0] for e in log] == ["stage_in", "stage_in", "allgather"]
    assert log[0][1:] == ([out.data_ptr()], [False]) and log[1][1:] == ([x.data_ptr()], [True])
    _, out_handed, in_handed, values = log[2]
    assert {out_handed, in_handed}.isdisjoint({out.data_ptr(), x.data_ptr()}) and values == x.tolist()
    assert out.tolist() == [-1.0] * 8
    work.wait()
    assert out.tolist() == x.tolist() * 2

    log.clear()
    swapped = torch.full((4,), -1.0)
    comm.all_to_all(swapped, x)  # blocking
    assert [e[0] for e in log] == ["stage_in", "stage_in", "alltoall", "wait"]
    assert {log[2][1], log[2][2]}.isdisjoint({swapped.data_ptr(), x.data_ptr()}) and swapped.tolist() == x.tolist()

    log.clear()
    m = torch.tensor([3.0])
    comm.all_reduce_max(m)
    assert [e[0] for e in log] == ["stage_in", "allreduce", "wait"] and log[1][1] != m.data_ptr()

    allocated = comm.staging.allocated
    y = torch.ones(4)
    comm.all_reduce_mean(y)  # a buffer of that size is free again: reused, nothing allocated
    assert y.tolist() == [1.0] * 4 and comm.staging.allocated == allocated > 0


def test_a_device_group_refuses_a_host_tensor_without_outer_offload():
    log = []
    comm = _comm(InterSiteDevices(group=GPU, run=GPU), log)
    with pytest.raises(WrongDevice, match="^all_reduce_mean: a tensor on cpu for an inter-site group on cuda:0"):
        comm.all_reduce_mean(torch.ones(2))
    assert log == []  # refused before the group (or the staging) saw it


@pytest.mark.parametrize("run", [CPU, GPU], ids=["cpu-run", "gpu-run"])
def test_a_host_group_takes_the_tensors_themselves(run):
    # gloo (a CPU run, or --inter-site-backend gloo on a GPU run): nothing staged, as before
    log = []
    comm = _comm(InterSiteDevices(group=CPU, run=run, host_payloads=True), log)
    comm._launch = lambda *args: pytest.fail("a host group's collective went through the staging path")
    x = torch.arange(4.0)
    comm.all_reduce_mean(x)
    out = torch.empty(8)
    comm.all_gather(out, x)
    swapped = torch.empty(4)
    comm.all_to_all(swapped, x)
    assert [e[0] for e in log] == ["allreduce", "wait", "allgather", "wait", "alltoall", "wait"]
    assert log[0][1] == x.data_ptr() and log[2][1:3] == (out.data_ptr(), x.data_ptr())
    assert log[4][1:3] == (swapped.data_ptr(), x.data_ptr())
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0] and out.tolist() == x.tolist() * 2 and comm.staging.allocated == 0
