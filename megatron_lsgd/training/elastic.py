"""Elastic sites in the training loop (--lsgd-fault-tolerance torchft, docs/fault_tolerance.md).

Each site is a torchrun job and a torch.distributed world of its own, so a dead site
takes no other site's process groups with it. Its cross-site traffic goes through the
torchft group of `TorchftMembership` (core/lsgd/fault_tolerance): the synchronizer's means
through `ElasticComm`, the loop's own few numbers through `membership.mean_over_sites`.

`elastic_site` builds the two; `register_healing_state` gives torchft what a site that
comes back needs to train on as if it had never stopped: this rank's model slice,
optimizer shard, synchronizer state (anchor, outer momentum, error feedback, round
position), LR schedule, RNG streams, and the loop's position (iteration, consumed
samples, hence the data stream; a site of a non-lockstep algorithm goes back to its own
iteration and stream position, which the loop asks of the synchronizer: `after_heal`). Every rank serves and receives its own shard: TP, PP and
ZeRO-1 need nothing more, since a rank's torchft group rank is its place in the site.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from megatron_lsgd.core.distributed.data_parallel import unwrap
from megatron_lsgd.core.lsgd.comm import SimulatedLink
from megatron_lsgd.core.lsgd.fault_tolerance.elastic_comm import ElasticComm
from megatron_lsgd.core.lsgd.fault_tolerance.lane_heal import merge_lanes
from megatron_lsgd.core.lsgd.fault_tolerance.lanes import group_rank
from megatron_lsgd.core.lsgd.fault_tolerance.torchft_membership import TorchftMembership
from megatron_lsgd.training.checkpointing.checkpointer import refresh_main_params
from megatron_lsgd.training.checkpointing.model_io import load_model_state, model_state
from megatron_lsgd.training.checkpointing.rng import capture_rng_state, restore_rng_state
from megatron_lsgd.training.data_samplers import build_data_iterator
from megatron_lsgd.training.run_state import BeforeHeal


def _site_store(host: str):
    """(address, port) of a TCP store for the site's torchft Managers, hosted by the site's
    rank 0 at `host` (collective over the site). A fresh store per start of the job:
    torchrun's own store outlives a restart and would hand the ranks the dead manager's
    address. Other sites' ranks meet there too when this site leads a quorum."""
    from torch.distributed import TCPStore

    store, where = None, [None]
    if dist.get_rank() == 0:
        store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        where = [(host, store.port)]
    dist.broadcast_object_list(where, src=0)
    return store, where[0]


def elastic_site(config, pgs, clock, devices):
    """(ElasticComm, TorchftMembership) for this rank: its torchft group is its dp_inter, on
    --inter-site-backend's device (gloo on the host even in a GPU run: sites sharing a GPU,
    or a link NCCL cannot use)."""
    ft = config.fault_tolerance
    host = ft.host or os.environ.get("MASTER_ADDR", "127.0.0.1")  # torchrun runs the site's rank 0 there
    store, (host, port) = _site_store(host)
    link = config.lsgd.link
    dims = config.dims
    comm = ElasticComm(dims.sites, SimulatedLink(link.latency_ms, link.bandwidth_mbit),
                       config.training.distributed_timeout_minutes, rank=pgs.rank, site=pgs.site_rank,
                       devices=devices, clock=clock, site_sizes=dims.site_dp if dims.heterogeneous else None)
    lanes = dims.lanes_of(pgs.site_rank, pgs.dp_intra_rank) if dims.heterogeneous else None
    membership = TorchftMembership(
        comm, config.fault_tolerance, site=pgs.site_rank, group_rank=dist.get_rank(),
        group_world_size=dist.get_world_size(), store_addr=host, store_port=port, device=devices.group,
        log=lambda line: print(line, flush=True), hostname=host,
        # sites of different sizes: a torchft group rank per lane (fault_tolerance/lanes.py)
        lane_ranks=None if lanes is None else [group_rank(pgs.tp_rank, j, pgs.pp_rank, dims.tp, dims.lanes)
                                               for j in lanes],
        lane_world=None if lanes is None else dims.tp * dims.pp * dims.lanes)
    membership.store = store  # the site's rank 0 keeps the store alive as long as the managers
    if lanes is not None:  # the synchronizer's lane-by-lane means (SiteSplit) run on the torchft lane groups
        pgs.inter_lanes = list(zip(lanes, membership.lane_pgs))
        comm.lane_groups = list(membership.lane_pgs)
    return comm, membership


def _copy(state):
    """A snapshot: torchft serves it while training goes on (views would drag their buffers along)."""
    return tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, state)


def register_healing_state(trainer, membership: TorchftMembership) -> None:
    """What a healing rank receives from the same rank of a live site (both at a quorum, at
    a step's start or at the job's end); with --lsgd-ft-digests, the anchor digests too."""
    pos = trainer.position  # the Trainer's for the run's life: a heal replaces its counters in place

    def snapshot():
        return _copy({"model": model_state(unwrap(trainer.model)), "optimizer": trainer.optimizer.state_dict(),
                      "synchronizer": trainer.synchronizer.state_dict(), "scheduler": trainer.scheduler.state_dict(),
                      "rng": capture_rng_state(trainer.rng_tracker),
                      "position": pos.state_dict(), "site_dp": trainer.pgs.dp_intra_size})

    pgs = trainer.pgs

    def restore(state) -> None:  # the order of a checkpoint load (checkpointer._load_local)
        # where the site stood (the trainer counts its log line and run from the new position)
        trainer.heal = BeforeHeal(pos.iteration, trainer.checkpoint_iteration, trainer.comm.snapshot(),
                                  trainer.clock.now())
        load_model_state(unwrap(trainer.model), state["model"], "the state received from a live site")
        refresh_main_params(trainer.optimizer)
        trainer.optimizer.load_state_dict(state["optimizer"])
        trainer.synchronizer.load_state_dict(state["synchronizer"])
        trainer.scheduler.load_state_dict(state["scheduler"])
        pos.load_state_dict(state["position"])
        if state.get("site_dp", pgs.dp_intra_size) != pgs.dp_intra_size:  # a peer of another size: its stream's pace
            pos.site_consumed_samples = pos.site_consumed_samples // state["site_dp"] * pgs.dp_intra_size
        trainer.loop.after_heal()  # the job's agreed count; a non-lockstep site's own iteration and stream position
        t = trainer.config.training
        trainer.train_iterator = build_data_iterator(trainer.train_ds, pos.site_consumed_samples,
                                                     t.micro_batch_size, pgs, trainer.config.data.num_workers)
        trainer.valid_iterator = build_data_iterator(trainer.valid_ds, pos.consumed_valid_samples // pgs.dims.sites,
                                                     t.micro_batch_size, pgs, trainer.config.data.num_workers,
                                                     cyclic=True)
        restore_rng_state(state["rng"], trainer.rng_tracker)  # last: building iterators draws from torch's
        trainer.heal.time = trainer.clock.now()  # the next log line's time starts after the transfer

    load, merge = restore, None
    if pgs.dims.heterogeneous:  # sites of different sizes: a heal from the ranks holding this rank's lanes
        lanes, sync = [lane for lane, _ in pgs.inter_lanes], trainer.synchronizer
        shards = [m.numel() for m in trainer.optimizer.main_param_shards()]

        def merge(payloads):
            return merge_lanes(payloads, lanes, pgs.dims.lanes, sync.per_parameter_state(), sync.per_part_state,
                               pgs.dp_intra_size, shards)

        if len(lanes) == 1:  # one Manager: its one payload, re-cut for this rank all the same
            load = lambda state: restore(merge([state]))  # noqa: E731
    membership.register_state("trainer", snapshot, load, merge=merge)
    digests = trainer.config.fault_tolerance.digests
    if digests:  # --lsgd-ft-digests: what chaos.py compares across sites
        held = trainer.synchronizer.held_alike  # what every site holds alike at a committed round
        if not pgs.dims.heterogeneous:
            membership.record_digests(os.path.join(digests, f"site{pgs.site_rank}_rank{dist.get_rank()}.jsonl"), held)
            return
        # sites of different sizes: a file per lane (its torchft group rank), of the lane's values,
        # which every site holds alike (a rank's own are its lanes': outside them they are stale)
        dims = pgs.dims
        for lane, _ in pgs.inter_lanes:
            name = f"site{pgs.site_rank}_lane{group_rank(pgs.tp_rank, lane, pgs.pp_rank, dims.tp, dims.lanes)}.jsonl"
            membership.record_digests(os.path.join(digests, name), lambda lane=lane: [
                t.view(-1)[lane * (t.numel() // dims.lanes):(lane + 1) * (t.numel() // dims.lanes)] for t in held()])

