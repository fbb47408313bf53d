"""InterSiteComm over torchft's reconfigurable process group.

The group is rebuilt by the torchft Manager at every quorum, and the number of sites is
the number present in the round (`set_sites`), so every mean in means.py and every
compressor averages over the sites that take part without knowing about faults. torchft's
wrapper groups implement the list-form collectives (allreduce, allgather, alltoall_base)
but not c10d's flat `*_single` ones, hence the overrides; the byte accounting and the
simulated link are InterSiteComm's.

On a device group (torchft's NCCL group: `devices.group` is the rank's GPU) every payload
is checked and, when it lives elsewhere (the host outer state of `--lsgd-outer-offload`),
staged onto the group's device and copied back when the collective is waited for, by the
same path as InterSiteComm's (`_launch`, devices.Staging). On the host (gloo) tensors go
to the group as they are, as before.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, AllToAllOptions, ReduceOp

from megatron_lsgd.core.lsgd.comm import InterSiteComm, InterSiteWork, SimulatedLink


class ElasticComm(InterSiteComm):
    def __init__(self, configured_sites: int, link: Optional[SimulatedLink] = None,
                 timeout_minutes: Optional[float] = None, rank: Optional[int] = None, site: Optional[int] = None,
                 devices=None, clock=None, site_sizes=None, lane_groups=()):
        # Until the first quorum the synchronizers see the configured sites (they decide
        # from num_sites > 1 whether there is anything to average).
        super().__init__(None, configured_sites, link, timeout_minutes, rank, site, devices=devices, clock=clock)
        self.configured_sites = configured_sites
        # Sites of different data-parallel sizes (every site's, in site order; None: equal): each
        # mean is weighted by the tokens of the sites present, and runs on the torchft lane
        # groups (`lane_groups`, this rank's, in lane order: fault_tolerance/lanes.py).
        self.site_sizes, self.lane_groups = site_sizes, list(lane_groups)
        if site_sizes:
            self.site_weight = site_sizes[site] / sum(site_sizes)

    def set_sites(self, group, present: int, sites=None) -> None:
        """The round's group (torchft's, reconfigured at the quorum) and how many sites it joins;
        `sites` (which), for the weights of sites of different sizes: a site that is not in
        the quorum does not keep its weight."""
        self.group = group
        self.num_sites = present
        if self.site_sizes and sites:
            self.site_weight = self.site_sizes[self.site] / sum(self.site_sizes[s] for s in sites)

    def _on_group(self, what: str, collective, output: torch.Tensor, tensor: Optional[torch.Tensor] = None):
        """collective(output, tensor) on the round's group: staged through the group's device
        when that is a device (NCCL) and a payload is not there (InterSiteComm._launch);
        on a host (gloo) group, on the tensors themselves."""
        if self.devices.group.type == "cpu":
            return collective(output, tensor)
        return self._launch(what, collective, output, tensor)

    def _reduce(self, tensor: torch.Tensor, op) -> object:
        opts = AllreduceOptions()
        opts.reduceOp = op
        return self.group.allreduce([tensor], opts)

    def all_reduce_mean(self, tensor: torch.Tensor, async_op: bool = False) -> InterSiteWork:
        if self.num_sites == 1:
            return InterSiteWork(self, None)
        tensor.mul_(1.0 / self.num_sites if self.site_weight is None else self.site_weight)
        moved = self._ring_bytes(tensor.numel() * tensor.element_size())
        work = self._on_group("all_reduce_mean", lambda out, _: self._reduce(out, ReduceOp.SUM), tensor)
        return self._finish(self._issue(work, moved, moved, self.phases("all_reduce")), async_op)

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False) -> InterSiteWork:
        if self.num_sites == 1:
            output.copy_(tensor.reshape(-1))
            return InterSiteWork(self, None)

        def gather(out: torch.Tensor, inp: torch.Tensor):
            parts = list(out.view(self.num_sites, -1).unbind(0))
            return self.group.allgather([parts], [inp.reshape(-1)], AllgatherOptions())

        work = self._on_group("all_gather", gather, output, tensor)
        moved = (self.num_sites - 1) * tensor.numel() * tensor.element_size()
        return self._finish(self._issue(work, moved, moved, self.phases("all_gather")), async_op)

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False) -> InterSiteWork:
        if self.num_sites == 1:
            output.copy_(tensor)
            return InterSiteWork(self, None)
        work = self._on_group("all_to_all", lambda out, inp: self.group.alltoall_base(out, inp, [], [],
                                                                                      AllToAllOptions()),
                              output, tensor)
        moved = (self.num_sites - 1) * tensor.numel() * tensor.element_size() // self.num_sites
        return self._finish(self._issue(work, moved, moved, self.phases("all_to_all")), async_op)

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        if self.num_sites == 1:
            return
        moved = self._ring_bytes(tensor.numel() * tensor.element_size())
        work = self._on_group("all_reduce_max", lambda out, _: self._reduce(out, ReduceOp.MAX), tensor)
        self._issue(work, moved, moved, self.phases("all_reduce")).wait()

    def use_dedicated_group(self, dims) -> list:
        """Nothing to do: the torchft groups are already this comm's alone (the lanes' groups
        with sites of different sizes, in lane order, for SiteSplit.on_lanes)."""
        return list(self.lane_groups) if self.site_sizes else []
