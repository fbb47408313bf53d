"""Device discipline for inter-site collectives (core/lsgd/devices.py): a tensor on a device
the group cannot take is refused before the backend sees it, the inter-site backend is
chosen as documented, and payloads staged through buffers on the group's device come back
with exactly the values an unstaged collective gives (two spawned gloo 'sites')."""

from __future__ import annotations

import inspect
import os
import re
import tempfile

import pytest
import torch
import torch.distributed as dist

from megatron_lsgd.core.lsgd.comm import InterSiteComm
from megatron_lsgd.core.lsgd.devices import (InterSiteDevices, WrongDevice, backend_device,
                                             choose_inter_site_backend)
from megatron_lsgd.core.lsgd.means import quantized_mean
from megatron_lsgd.core.lsgd.membership import AllSites, UnequalSites
from megatron_lsgd.core.lsgd.reduction import run_blocking
from megatron_lsgd.core.parallel_state import ParallelDims, build_process_groups
from tests.unit_tests.harness import free_port, spawn

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)  # GPU is only declared, never allocated on


def test_a_planted_host_tensor_is_refused_before_the_backend_sees_it():
    # An NCCL dp_inter on a GPU run: the group is None, so reaching the backend would fail
    # differently; WrongDevice proves the check runs first, for every collective.
    comm = InterSiteComm(None, 2, devices=InterSiteDevices(group=GPU, run=GPU))
    x = torch.ones(4)
    calls = {"all_reduce_mean": lambda: comm.all_reduce_mean(x, async_op=True),
             "all_reduce_max": lambda: comm.all_reduce_max(x),
             "all_gather": lambda: comm.all_gather(torch.empty(8), x, async_op=True),
             "all_to_all": lambda: comm.all_to_all(torch.empty(4), x, async_op=True)}
    for what, call in calls.items():
        with pytest.raises(WrongDevice, match=f"^{what}: a tensor on cpu for an inter-site group on cuda:0"):
            call()
    assert comm.bytes_sent == 0  # nothing was counted as sent either


def test_the_loops_own_inter_site_all_reduces_are_checked():
    nccl = InterSiteDevices(group=GPU, run=GPU)
    with pytest.raises(WrongDevice, match="^the log line's means: a tensor on cpu for an inter-site group on cuda:0"):
        nccl.all_reduce("the log line's means", torch.ones(2), None)  # None: the check runs before any backend
    # the training loops reach dp_inter only through the membership, whose plain form
    # (AllSites) reduces through that checked path
    members = AllSites(None, num_sites=2, devices=nccl)
    with pytest.raises(WrongDevice, match="^the loop's mean over sites: a tensor on cpu"):
        members.mean_over_sites(torch.ones(2))
    with pytest.raises(WrongDevice, match="^the loop's sum over sites: a tensor on cpu"):
        members.sum_over_sites(torch.ones(1, dtype=torch.int64))
    import megatron_lsgd.training.lockstep_loop as lockstep
    import megatron_lsgd.training.meeting_loop as meeting
    import megatron_lsgd.training.training as trainer
    source = "".join(inspect.getsource(m) for m in (trainer, lockstep, meeting))
    assert "AllSites(pgs.dp_inter, dims.sites, devices)" in source
    # sites of different sizes: the weighted form (over the dp group) takes the same path
    assert "UnequalSites(pgs.dp, dims.sites, devices," in source
    unequal = UnequalSites(None, 2, nccl, lead=True, weight=2 / 3)
    with pytest.raises(WrongDevice, match="^the loop's mean over sites: a tensor on cpu"):
        unequal.mean_over_sites(torch.ones(2))
    with pytest.raises(WrongDevice, match="^the loop's sum over sites: a tensor on cpu"):
        unequal.sum_over_sites(torch.ones(1, dtype=torch.int64))
    assert not re.search(r"dist\.\w+\((?:[^()]|\([^()]*\))*dp_inter", source)
    assert not re.search(r"\.all_reduce\((?:[^()]|\([^()]*\))*dp_inter", source)


def test_which_devices_an_inter_site_group_accepts():
    nccl = InterSiteDevices(group=GPU, run=GPU)
    assert nccl.allowed(torch.device("cuda")) and not nccl.allowed(CPU)
    assert not nccl.allowed(torch.device("cuda", 1))  # another rank's GPU
    offloaded = InterSiteDevices(group=GPU, run=GPU, host_payloads=True)  # --lsgd-outer-offload
    assert offloaded.allowed(CPU) and offloaded.needs_staging(torch.empty(1))
    gloo_on_gpus = InterSiteDevices(group=CPU, run=GPU)
    assert gloo_on_gpus.allowed(GPU) and gloo_on_gpus.allowed(CPU)
    assert not gloo_on_gpus.needs_staging(torch.empty(1))
    assert not InterSiteDevices(group=GPU, run=GPU, host_payloads=True).allowed(torch.device("meta"))


def test_inter_site_backend_choice():
    assert choose_inter_site_backend(None, GPU) == "nccl"
    assert choose_inter_site_backend(None, CPU) == "gloo"
    assert choose_inter_site_backend("gloo", GPU) == "gloo"  # gloo between sites, NCCL inside them
    assert choose_inter_site_backend("nccl", GPU) == "nccl"
    with pytest.raises(ValueError, match="^--inter-site-backend nccl needs CUDA"):
        choose_inter_site_backend("nccl", CPU)
    assert backend_device("gloo", GPU) == CPU and backend_device("nccl", GPU) == GPU
    assert backend_device("gloo", CPU) == CPU


class _AlwaysStaged(InterSiteDevices):
    """On a CPU-only machine nothing needs staging; force it to test the staging path."""

    def needs_staging(self, tensor):
        return True


def _staging_job(rank, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    # the explicit --inter-site-backend path: dp_inter (and a dedicated copy of it) on gloo
    # (a CPU world is gloo anyway: record which groups were asked for gloo explicitly)
    new_group, asked = dist.new_group, []
    dist.new_group = lambda ranks, **kw: asked.append(kw.get("backend")) or new_group(ranks, **kw)
    try:
        pgs = build_process_groups(ParallelDims(tp=1, pp=1, dp_intra=1, sites=2), inter_site_backend="gloo")
    finally:
        dist.new_group = new_group
    record = {"backend": (pgs.inter_site_backend, dist.get_backend(pgs.dp_inter)), "asked": asked}
    plain = InterSiteComm(pgs.dp_inter, 2)
    staged = InterSiteComm(pgs.dp_inter, 2, devices=_AlwaysStaged(group=CPU, run=CPU))
    staged.use_dedicated_group(pgs.dims)
    record["dedicated_backend"] = dist.get_backend(staged.group)
    results = {}
    for name, comm in (("plain", plain), ("staged", staged)):
        out = {}
        for round_ in range(3):  # reused buffers must not leak one round's values into the next
            x = torch.randn(2, 50, generator=torch.Generator().manual_seed(rank * 10 + round_))
            y = x.clone()
            work = comm.all_reduce_mean(y, async_op=True)
            if name == "staged":  # in place, but only once waited for: the payload is untouched until then
                out[f"untouched{round_}"] = torch.equal(y, x / 2)  # (scaled by 1/S before issue)
            work.wait()
            out[f"mean{round_}"] = y
            gathered = torch.empty(200)
            comm.all_gather(gathered, x.reshape(-1))
            out[f"gather{round_}"] = gathered
            swapped = torch.empty(100)
            comm.all_to_all(swapped, x.reshape(-1))
            out[f"a2a{round_}"] = swapped
            m = torch.tensor([float(rank + round_)])
            comm.all_reduce_max(m)
            out[f"max{round_}"] = m
            out[f"q{round_}"] = run_blocking(quantized_mean(comm, x.reshape(-1), 8, 32, "alltoall"))[0]
            control = torch.tensor([float(rank + 1), 2.0 * round_])  # the loop's own few values
            comm.devices.all_reduce("control", control, pgs.dp_inter)
            out[f"control{round_}"] = control
            if name == "staged" and round_ == 0:
                record["allocated_after_one_round"] = comm.staging.allocated
        results[name] = out
    record["results"] = results
    record["allocated"] = staged.staging.allocated
    torch.save(record, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_staged_collectives_give_the_unstaged_values_and_reuse_their_buffers():
    with tempfile.TemporaryDirectory() as d:
        spawn(_staging_job, args=(free_port(), d), nprocs=2)
        records = [torch.load(os.path.join(d, f"{r}.pt"), weights_only=False) for r in range(2)]
    for rec in records:
        assert rec["backend"] == ("gloo", "gloo") and rec["dedicated_backend"] == "gloo"
        assert rec["asked"].count("gloo") == 1 < len(rec["asked"])  # dp_inter, and no other group
        plain, staged = rec["results"]["plain"], rec["results"]["staged"]
        for key, value in plain.items():
            assert torch.equal(staged[key], value), key  # bit for bit
        assert all(staged[f"untouched{r}"] for r in range(3))
        # the first round's buffers serve the next two rounds: nothing new is allocated
        assert rec["allocated"] == rec["allocated_after_one_round"] > 0
    # sites agree
    assert torch.equal(records[0]["results"]["staged"]["mean2"], records[1]["results"]["staged"]["mean2"])
