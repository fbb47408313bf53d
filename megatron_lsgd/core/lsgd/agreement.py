"""Agreement on a few control values (flags, measured times, a proposed interval) inside a
site and across the job, written once for every synchronizer: the site's ranks must take the
same timing-driven decisions, or their collectives stop matching."""

from __future__ import annotations

import torch
import torch.distributed as dist


def agree_in_site(values: torch.Tensor, pgs, op=dist.ReduceOp.SUM) -> int:
    """Reduce `values` in place over this rank's site (nothing crosses sites; the tensor is on
    the training device, as the site group may be NCCL). Returns the site's rank count (1:
    nothing to agree with)."""
    site = getattr(pgs, "site", None)
    if site is None or not dist.is_initialized():
        return 1
    ranks = dist.get_world_size(site)
    if ranks > 1:
        dist.all_reduce(values, op=op, group=site)
    return ranks


def failed_anywhere_in_site(ok: bool, pgs, device: torch.device) -> bool:
    """Whether this rank or any other of its site saw a failure (`ok` False): an elastic
    round's cross-site collectives may fail on some of a site's links only, and the site's
    ranks, whose later collectives inside the site follow the outcome, must all act on it."""
    failed = torch.tensor([0.0 if ok else 1.0], dtype=torch.float64, device=device)
    agree_in_site(failed, pgs, dist.ReduceOp.MAX)
    return bool(failed.item())


def agree_max_in_job(values: torch.Tensor, pgs, comm, lanes=()) -> None:
    """Element-wise maximum over every rank of the job, in place: inside the site, then across
    sites (each rank then holds its site's maximum, so the inter-site group completes it).
    `lanes`: this rank's lane groups when sites differ in size (site_split.SiteSplit.lanes):
    a group joins one rank of each site only per lane, so the maximum runs on every lane."""
    agree_in_site(values, pgs, dist.ReduceOp.MAX)
    for group in lanes or [None]:
        with comm.on_group(group):
            comm.all_reduce_max(values)
