"""Parallel layout and process groups, built once and passed around explicitly.

World = TP x PP x DP with DP = DP_intra x S (S sites). Rank order, fastest-varying first:
tp, dp_intra, pp, site. A site is therefore a contiguous block of ranks, which is what
node-major `torchrun` placement gives when each site is one (or more) whole nodes.

Nothing in the model reaches for global state: layers receive the `ProcessGroups` object
(or the one group they need) from their constructor.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist


@dataclass(frozen=True)
class ParallelDims:
    tp: int = 1
    pp: int = 1
    dp_intra: int = 1
    sites: int = 1

    @property
    def dp(self) -> int:
        return self.dp_intra * self.sites

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @classmethod
    def from_world(cls, world_size: int, tp: int, pp: int, sites: int) -> "ParallelDims":
        """Derive DP_intra from the world size, with messages that name the flag to fix."""
        for flag, value in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                            ("--num-sites", sites)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1 (got {value})")
        model_parallel = tp * pp
        if world_size % model_parallel:
            raise ValueError(
                f"world size {world_size} is not divisible by tensor ({tp}) x pipeline ({pp}) parallel size "
                f"= {model_parallel}: change --tensor-model-parallel-size/--pipeline-model-parallel-size "
                f"or the number of processes")
        dp = world_size // model_parallel
        if dp % sites:
            raise ValueError(
                f"data-parallel size {dp} (= world {world_size} / (TP {tp} x PP {pp})) is not divisible by "
                f"--num-sites {sites}: every site needs the same number of data-parallel ranks")
        return cls(tp=tp, pp=pp, dp_intra=dp // sites, sites=sites)

    def coords(self, rank: int) -> "RankCoords":
        tp_rank = rank % self.tp
        rest = rank // self.tp
        dp_intra_rank = rest % self.dp_intra
        rest //= self.dp_intra
        pp_rank = rest % self.pp
        site = rest // self.pp
        return RankCoords(tp=tp_rank, dp_intra=dp_intra_rank, pp=pp_rank, site=site)

    def rank_of(self, tp: int, dp_intra: int, pp: int, site: int) -> int:
        return tp + self.tp * (dp_intra + self.dp_intra * (pp + self.pp * site))


@dataclass(frozen=True)
class RankCoords:
    tp: int
    dp_intra: int
    pp: int
    site: int


def enumerate_group_ranks(dims: ParallelDims) -> Dict[str, List[Tuple[int, ...]]]:
    """Every group of every kind, as tuples of global ranks (pure; unit-testable)."""
    r = dims.rank_of
    groups: Dict[str, List[Tuple[int, ...]]] = {k: [] for k in (
        "tp", "pp", "dp", "dp_intra", "dp_inter", "model_parallel", "embedding", "site")}
    for site in range(dims.sites):
        for pp in range(dims.pp):
            for dpi in range(dims.dp_intra):
                groups["tp"].append(tuple(r(t, dpi, pp, site) for t in range(dims.tp)))
        for pp in range(dims.pp):
            for tp in range(dims.tp):
                groups["dp_intra"].append(tuple(r(tp, d, pp, site) for d in range(dims.dp_intra)))
        for dpi in range(dims.dp_intra):
            for tp in range(dims.tp):
                groups["pp"].append(tuple(r(tp, dpi, p, site) for p in range(dims.pp)))
                stages = sorted({0, dims.pp - 1})
                groups["embedding"].append(tuple(r(tp, dpi, p, site) for p in stages))
            groups["model_parallel"].append(tuple(
                r(t, dpi, p, site) for p in range(dims.pp) for t in range(dims.tp)))
        groups["site"].append(tuple(
            r(t, d, p, site) for p in range(dims.pp) for d in range(dims.dp_intra) for t in range(dims.tp)))
    for pp in range(dims.pp):
        for tp in range(dims.tp):
            groups["dp"].append(tuple(
                r(tp, d, pp, s) for s in range(dims.sites) for d in range(dims.dp_intra)))
            for dpi in range(dims.dp_intra):
                groups["dp_inter"].append(tuple(r(tp, dpi, pp, s) for s in range(dims.sites)))
    return groups


@dataclass
class ProcessGroups:
    """The groups this rank belongs to, plus its coordinates and pipeline neighbours.

    - tp: tensor-parallel peers; pp: pipeline stages; dp: all data-parallel replicas;
    - dp_intra: replicas inside this site (gradients reduced and ZeRO-1 sharded here);
    - dp_inter: same (tp, pp, dp_intra) coordinate on every site (what crosses sites);
    - model_parallel: tp x pp (for global norms); embedding: first and last stage (tied
      word embeddings); site: every rank of this site (cheap intra-site agreement).
    """

    dims: ParallelDims
    rank: int
    coords: RankCoords
    tp: Optional[dist.ProcessGroup] = None
    pp: Optional[dist.ProcessGroup] = None
    dp: Optional[dist.ProcessGroup] = None
    dp_intra: Optional[dist.ProcessGroup] = None
    dp_inter: Optional[dist.ProcessGroup] = None
    model_parallel: Optional[dist.ProcessGroup] = None
    embedding: Optional[dist.ProcessGroup] = None
    site: Optional[dist.ProcessGroup] = None
    group_ranks: Dict[str, Tuple[int, ...]] = field(default_factory=dict)
    inter_site_backend: Optional[str] = None  # dp_inter's backend when it differs from the world's
    # The global rank of the torch.distributed world's rank 0: 0, or the site's first rank when
    # each site is a world of its own (fault tolerance: no group crosses sites, dp and
    # dp_inter are None and cross-site traffic goes through the torchft group).
    world_offset: int = 0

    def world_rank(self, rank: int) -> int:
        """A global rank as a rank of the torch.distributed world (point-to-point peers)."""
        return rank - self.world_offset

    @property
    def tp_rank(self) -> int:
        return self.coords.tp

    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    @property
    def dp_intra_rank(self) -> int:
        return self.coords.dp_intra

    @property
    def site_rank(self) -> int:
        return self.coords.site

    @property
    def dp_rank(self) -> int:
        """Index among all data-parallel replicas (site-major), used to pick samples."""
        return self.coords.site * self.dims.dp_intra + self.coords.dp_intra

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp == self.dims.pp - 1

    @property
    def prev_stage_rank(self) -> Optional[int]:
        c = self.coords
        return None if self.is_first_stage else self.dims.rank_of(c.tp, c.dp_intra, c.pp - 1, c.site)

    @property
    def next_stage_rank(self) -> Optional[int]:
        c = self.coords
        return None if self.is_last_stage else self.dims.rank_of(c.tp, c.dp_intra, c.pp + 1, c.site)


def build_process_groups(dims: ParallelDims, timeout=None, inter_site_backend: Optional[str] = None,
                         only_site: Optional[int] = None) -> ProcessGroups:
    """Create every group (collectively: all ranks call new_group for all groups in the
    same order) and keep the ones this rank belongs to. `inter_site_backend` (e.g. gloo
    between sites while NCCL runs inside them) applies to dp_inter only. `only_site`: the
    world is that site alone (fault tolerance): its groups only, ranks stay global."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialized before building process groups")
    world = dist.get_world_size()
    expected = dims.world_size if only_site is None else dims.world_size // dims.sites
    if world != expected:
        raise ValueError(f"parallel layout {dims} needs {expected} ranks {'per site ' if only_site is not None else ''}"
                         f"but the world has {world}")
    offset = 0 if only_site is None else only_site * expected
    rank = dist.get_rank() + offset
    pgs = ProcessGroups(dims=dims, rank=rank, coords=dims.coords(rank), inter_site_backend=inter_site_backend,
                        world_offset=offset)
    kwargs = {"timeout": timeout} if timeout is not None else {}
    for kind, all_ranks in enumerate_group_ranks(dims).items():
        seen = set()
        backend = {"backend": inter_site_backend} if kind == "dp_inter" and inter_site_backend else {}
        for ranks in all_ranks:
            if ranks in seen:  # pp == 1: embedding group {0} == {pp-1}; create each once
                continue
            seen.add(ranks)
            if only_site is not None:
                if not all(offset <= r < offset + world for r in ranks):
                    continue  # crosses sites, or another site's: not in this world
                group = dist.new_group([r - offset for r in ranks], **kwargs)
                if rank in ranks:
                    setattr(pgs, kind, group)
                    pgs.group_ranks[kind] = ranks
                continue
            group = dist.new_group(list(ranks), **kwargs, **backend)
            if rank in ranks:
                setattr(pgs, kind, group)
                pgs.group_ranks[kind] = ranks
    return pgs


def clone_groups(pgs: ProcessGroups, kinds: Sequence[str], timeout=None, backend: Optional[str] = None
                 ) -> ProcessGroups:
    """A copy of `pgs` in which the groups of the given kinds are fresh process groups with
    the same members (collective: every rank calls it with the same kinds, in the same
    order). For a thread that issues collectives beside the main thread: each process group
    needs one order of collectives on all its members, which two threads sharing a group
    could not guarantee. `backend`: the fresh groups' (default: the world's)."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialized before building process groups")
    kwargs = {"timeout": timeout} if timeout is not None else {}
    if backend is not None:
        kwargs["backend"] = backend
    fresh = {}
    all_groups = enumerate_group_ranks(pgs.dims)
    for kind in kinds:
        seen = set()
        for ranks in all_groups[kind]:
            if ranks in seen:
                continue
            seen.add(ranks)
            group = dist.new_group(list(ranks), **kwargs)
            if pgs.rank in ranks:
                fresh[kind] = group
    return dataclasses.replace(pgs, **fresh)
