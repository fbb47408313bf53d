"""The end-of-run line that says what the cross-site algorithm saved.

Bytes across sites are counted where the collectives are issued (InterSiteComm: sent plus
received by each rank). The comparison is what per-step synchronization (`sync`, plain
fp32) would have moved for the same steps: every step, each rank all-reduces its own
gradient shard over its sites, counted the same way (ring all-reduce: 2 (S-1)/S of the
shard each way). Both totals are summed over all ranks. For `sync` itself (compressed or not)
the line names that comparison "uncompressed per-step sync".
"""

from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist


def sync_bytes_per_step(comm, grad_shards) -> int:
    """Sent + received by this rank for one fp32 all-reduce of its gradient shards."""
    nbytes = sum(g.numel() for g in grad_shards) * 4
    return 2 * comm._ring_bytes(nbytes)


def cross_site_traffic(comm, grad_shards, steps: int, device: torch.device) -> Dict[str, float]:
    """Collective over the world's ranks: {"bytes": moved by the run, "sync_bytes": per-step sync}.
    `device`: the run's device (the world group is NCCL on GPUs, which takes no host tensor)."""
    snap = comm.snapshot()
    mine = torch.tensor([snap["bytes_sent"] + snap["bytes_received"],
                         steps * sync_bytes_per_step(comm, grad_shards)], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(mine)
    return {"bytes": float(mine[0]), "sync_bytes": float(mine[1])}


def summary_line(algorithm: str, steps: int, traffic: Dict[str, float], ranks: str = "all ranks") -> str:
    """`ranks`: whose traffic cross_site_traffic summed (its world's: one site's under fault tolerance)."""
    moved, sync = traffic["bytes"], traffic["sync_bytes"]
    # sync compared with "per-step sync" reads as itself: name what differs, its payload
    baseline = "uncompressed per-step sync" if algorithm == "sync" else "per-step sync"
    ratio = _ratio(algorithm, baseline, moved, sync)
    return (f" cross-site traffic: {algorithm} moved {moved / 2**20:.2f} MB (sent + received, {ranks}) in {steps} "
            f"steps; {baseline} would have moved {sync / 2**20:.2f} MB ({ratio})")


def _ratio(algorithm: str, baseline: str, moved: float, sync: float) -> str:
    """"356x less", "2.0x more" or "the same": never "0x less" for an algorithm that sent more."""
    if moved <= 0:
        return f"nothing with {algorithm}"
    if moved > sync * 1.005:
        return f"{moved / sync:.1f}x more with {algorithm}" if sync > 0 else f"{baseline} moves nothing"
    if moved * 1.005 >= sync:
        return f"the same with {algorithm}"
    less = sync / moved
    return f"{less:.0f}x less with {algorithm}" if less >= 10 else f"{less:.1f}x less with {algorithm}"
