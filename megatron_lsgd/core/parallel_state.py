"""Parallel layout and process groups, built once and passed around explicitly.

World = TP x PP x DP with DP = DP_intra x S (S sites). Rank order, fastest-varying first:
tp, dp_intra, pp, site. A site is therefore a contiguous block of ranks, which is what
node-major `torchrun` placement gives when each site is one (or more) whole nodes.

Sites may have different data-parallel sizes (`--site-data-parallel-sizes`, `site_dp`):
site s then has DP_s ranks per (tp, pp) and starts after the TP x PP x DP_t ranks of the
sites before it. What crosses sites is cut into L = lcm(DP_s) *lanes* (a bucket is padded
to a multiple of L): lane j is the j-th L-th of every bucket, held on site s by its
dp_intra rank j // (L / DP_s), and one dp_inter group per lane joins those holders. A rank
of a site with DP_s < L takes part in L / DP_s lanes (`ProcessGroups.inter_lanes`). With
equal sites L = DP_intra and lane j is dp_intra rank j everywhere: the groups of before.

Sites may also have different tensor x pipeline layouts (--site-tensor-model-parallel-sizes,
--site-pipeline-model-parallel-sizes: `site_tp`, `site_pp`, the DiLoCo exchange in the
canonical form of core/lsgd/canonical_exchange.py). Site s then has TP_s x PP_s x DP_s
ranks, `tp` and `pp` are the values of the site a `ProcessGroups` belongs to (`for_site`),
and a lane is a range of the canonical form: L = lcm of the sites' rank counts R_s, lane j
held on site s by its site-local rank j // (L / R_s), one dp_inter group per lane. No group
joins a (tp, pp) coordinate across sites (there is no `dp` group); `last_stages` joins the
last pipeline stage's ranks of every site (the loop's losses).

Nothing in the model reaches for global state: layers receive the `ProcessGroups` object
(or the one group they need) from their constructor.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist


@dataclass(frozen=True)
class ParallelDims:
    tp: int = 1
    pp: int = 1
    dp_intra: int = 1  # every site's DP size; 0 when the sites differ (see site_dp)
    sites: int = 1
    site_dp: Tuple[int, ...] = ()  # per-site DP sizes when they differ (--site-data-parallel-sizes)
    # per-site TP and PP sizes when the sites' layouts differ (module docstring); tp and pp
    # are then one site's (`for_site`)
    site_tp: Tuple[int, ...] = ()
    site_pp: Tuple[int, ...] = ()

    @property
    def heterogeneous(self) -> bool:
        return bool(self.site_dp)

    @property
    def mixed_layouts(self) -> bool:
        """The sites' tensor x pipeline layouts differ."""
        return bool(self.site_tp)

    def tp_of(self, site: int) -> int:
        return self.site_tp[site] if self.site_tp else self.tp

    def pp_of(self, site: int) -> int:
        return self.site_pp[site] if self.site_pp else self.pp

    def for_site(self, site: int) -> "ParallelDims":
        """These dims as seen from `site`: tp and pp are its own."""
        return dataclasses.replace(self, tp=self.tp_of(site), pp=self.pp_of(site)) if self.site_tp else self

    def site_start(self, site: int) -> int:
        """The global rank of the site's first rank."""
        return sum(self.ranks_of_site(t) for t in range(site))

    def lane_holders(self, site: int) -> int:
        """How many ranks of a site share the lanes: its replicas, or every rank when layouts differ."""
        return self.ranks_of_site(site) if self.site_tp else self.dp_of(site)

    @property
    def site_sizes(self) -> Tuple[int, ...]:
        """Every site's data-parallel size, in site order."""
        return self.site_dp if self.site_dp else (self.dp_intra,) * self.sites

    def dp_of(self, site: int) -> int:
        return self.site_dp[site] if self.site_dp else self.dp_intra

    def dp_offset(self, site: int) -> int:
        """Data-parallel index (site-major) of the site's first replica."""
        return sum(self.site_dp[:site]) if self.site_dp else site * self.dp_intra

    def ranks_of_site(self, site: int) -> int:
        return self.tp_of(site) * self.pp_of(site) * self.dp_of(site)

    def site_part(self, samples: int, site: int) -> int:
        """A site's part of the job's `samples` (samples // S when the sites are equal)."""
        return samples * self.dp_of(site) // self.dp

    def site_share(self, site: int) -> float:
        """The site's share of every global batch (its replicas' share of all replicas)."""
        return self.dp_of(site) / self.dp

    @property
    def vocab_tp(self) -> int:
        """The TP size the vocabulary is padded for: the lcm of the sites' (one padded
        vocabulary, so one canonical model, that every site's TP slices evenly)."""
        return math.lcm(*(self.tp_of(s) for s in range(self.sites)))

    @property
    def lanes(self) -> int:
        """L: what crosses sites is cut into L lanes (lcm of the sites' DP sizes, or of their
        rank counts when layouts differ)."""
        return math.lcm(*(self.lane_holders(s) for s in range(self.sites)))

    def lanes_of(self, site: int, holder: int) -> List[int]:
        """The lanes a replica (dp_intra rank; site-local rank when layouts differ) holds:
        L / holders consecutive ones."""
        per = self.lanes // self.lane_holders(site)
        return list(range(holder * per, (holder + 1) * per))

    @property
    def dp(self) -> int:
        return sum(self.site_dp) if self.site_dp else self.dp_intra * self.sites

    @property
    def world_size(self) -> int:
        if self.site_tp:
            return sum(self.ranks_of_site(s) for s in range(self.sites))
        return self.tp * self.pp * self.dp

    @classmethod
    def from_world(cls, world_size: int, tp: int, pp: int, sites: int,
                   site_dp: Optional[Sequence[int]] = None, site_tp: Optional[Sequence[int]] = None,
                   site_pp: Optional[Sequence[int]] = None) -> "ParallelDims":
        """Derive DP_intra from the world size, with messages that name the flag to fix.
        `site_dp`: per-site data-parallel sizes (--site-data-parallel-sizes); `site_tp`,
        `site_pp`: per-site layouts (--site-tensor/pipeline-model-parallel-sizes). Equal sizes
        give the same dims as without them."""
        for flag, value in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                            ("--num-sites", sites)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1 (got {value})")
        if site_tp is not None or site_pp is not None:
            return cls._site_layouts(world_size, tp, pp, sites, site_dp, site_tp, site_pp)
        model_parallel = tp * pp
        if site_dp is not None:
            sizes = _per_site("--site-data-parallel-sizes", site_dp, sites, "needs at least one data-parallel rank")
            given = ",".join(str(d) for d in sizes)
            if sum(sizes) * model_parallel != world_size:
                raise ValueError(
                    f"--site-data-parallel-sizes {given} sum to {sum(sizes)} data-parallel ranks, x TP {tp} x PP {pp} "
                    f"= {sum(sizes) * model_parallel} ranks, but the world has {world_size}")
            if len(set(sizes)) == 1:
                return cls(tp=tp, pp=pp, dp_intra=sizes[0], sites=sites)
            return cls(tp=tp, pp=pp, dp_intra=0, sites=sites, site_dp=sizes)
        if world_size % model_parallel:
            raise ValueError(
                f"world size {world_size} is not divisible by tensor ({tp}) x pipeline ({pp}) parallel size "
                f"= {model_parallel}: change --tensor-model-parallel-size/--pipeline-model-parallel-size "
                f"or the number of processes")
        dp = world_size // model_parallel
        if dp % sites:
            raise ValueError(
                f"data-parallel size {dp} (= world {world_size} / (TP {tp} x PP {pp})) is not divisible by "
                f"--num-sites {sites}: give every site the same number of data-parallel ranks, or each its own "
                f"with --site-data-parallel-sizes")
        return cls(tp=tp, pp=pp, dp_intra=dp // sites, sites=sites)

    @classmethod
    def _site_layouts(cls, world_size: int, tp: int, pp: int, sites: int, site_dp, site_tp, site_pp
                      ) -> "ParallelDims":
        """Sites of their own TP x PP (and, with `site_dp`, their own numbers of replicas)."""
        layouts = []
        for flag, plain_flag, plain, given in (
                ("--site-tensor-model-parallel-sizes", "--tensor-model-parallel-size", tp, site_tp),
                ("--site-pipeline-model-parallel-sizes", "--pipeline-model-parallel-size", pp, site_pp)):
            if given is None:
                layouts.append((plain,) * sites)
                continue
            sizes = _per_site(flag, given, sites, "needs a size of at least 1")
            if plain != 1:
                raise ValueError(f"{flag} {','.join(map(str, sizes))} gives every site its own size: leave out "
                                 f"{plain_flag} {plain}")
            layouts.append(sizes)
        tps, pps = layouts
        if len(set(zip(tps, pps))) == 1:  # one layout after all: the plain dims
            return cls.from_world(world_size, tps[0], pps[0], sites, site_dp)
        if site_dp is not None:  # each site its own replica count too
            dps = _per_site("--site-data-parallel-sizes", site_dp, sites, "needs at least one data-parallel rank")
            ranks = [t * p * d for t, p, d in zip(tps, pps, dps)]
            if sum(ranks) != world_size:
                raise ValueError(f"--site-data-parallel-sizes {','.join(map(str, dps))} with the sites' TP x PP "
                                 f"take {' + '.join(map(str, ranks))} = {sum(ranks)} ranks, but the world has "
                                 f"{world_size}")
            if len(set(dps)) > 1:
                return cls(tp=tps[0], pp=pps[0], dp_intra=0, sites=sites, site_dp=dps, site_tp=tps, site_pp=pps)
            return cls(tp=tps[0], pp=pps[0], dp_intra=dps[0], sites=sites, site_tp=tps, site_pp=pps)
        per_replica = sum(t * p for t, p in zip(tps, pps))
        if world_size % per_replica:
            shapes = " + ".join(f"{t}x{p}" for t, p in zip(tps, pps))
            raise ValueError(f"--site-tensor-model-parallel-sizes/--site-pipeline-model-parallel-sizes: one replica "
                             f"on every site takes TP x PP = {shapes} = {per_replica} ranks, which does not divide "
                             f"the world of {world_size}")
        return cls(tp=tps[0], pp=pps[0], dp_intra=world_size // per_replica, sites=sites, site_tp=tps, site_pp=pps)

    def site_of_rank(self, rank: int) -> int:
        if not self.site_dp and not self.site_tp:
            return rank // (self.tp * self.pp * self.dp_intra)
        start = 0
        for site in range(self.sites):
            start += self.ranks_of_site(site)
            if rank < start:
                return site
        raise ValueError(f"rank {rank} is outside the world of {self.world_size}")

    def coords(self, rank: int) -> "RankCoords":
        if self.site_dp or self.site_tp:
            site = self.site_of_rank(rank)
            rest = rank - self.site_start(site)
            d, tp = self.dp_of(site), self.tp_of(site)
            return RankCoords(tp=rest % tp, dp_intra=(rest // tp) % d, pp=rest // (tp * d), site=site)
        tp_rank = rank % self.tp
        rest = rank // self.tp
        dp_intra_rank = rest % self.dp_intra
        rest //= self.dp_intra
        pp_rank = rest % self.pp
        site = rest // self.pp
        return RankCoords(tp=tp_rank, dp_intra=dp_intra_rank, pp=pp_rank, site=site)

    def rank_of(self, tp: int, dp_intra: int, pp: int, site: int) -> int:
        if self.site_tp:
            return self.site_start(site) + tp + self.tp_of(site) * (dp_intra + self.dp_of(site) * pp)
        if self.site_dp:
            return self.tp * self.pp * self.dp_offset(site) + tp + self.tp * (dp_intra + self.dp_of(site) * pp)
        return tp + self.tp * (dp_intra + self.dp_intra * (pp + self.pp * site))


def _per_site(flag: str, given: Sequence[int], sites: int, at_least: str) -> Tuple[int, ...]:
    """One whole number >= 1 per site, or an error naming `flag`."""
    sizes = tuple(int(v) for v in given)
    text = ",".join(map(str, sizes))
    if len(sizes) != sites:
        raise ValueError(f"{flag} {text} names {len(sizes)} sites but --num-sites is {sites}: give one size per site")
    if any(v < 1 for v in sizes):
        raise ValueError(f"{flag} {text}: every site {at_least}")
    return sizes


@dataclass(frozen=True)
class RankCoords:
    tp: int
    dp_intra: int
    pp: int
    site: int


def enumerate_group_ranks(dims: ParallelDims) -> Dict[str, List[Tuple[int, ...]]]:
    """Every group of every kind, as tuples of global ranks (pure; unit-testable)."""
    r = dims.rank_of
    kinds = ("tp", "pp", "dp", "dp_intra", "dp_inter", "model_parallel", "embedding", "site")
    groups: Dict[str, List[Tuple[int, ...]]] = {k: [] for k in kinds + (("last_stages",) if dims.site_tp else ())}
    for site in range(dims.sites):
        dp_site, tp_site, pp_site = dims.dp_of(site), dims.tp_of(site), dims.pp_of(site)
        for pp in range(pp_site):
            for dpi in range(dp_site):
                groups["tp"].append(tuple(r(t, dpi, pp, site) for t in range(tp_site)))
        for pp in range(pp_site):
            for tp in range(tp_site):
                groups["dp_intra"].append(tuple(r(tp, d, pp, site) for d in range(dp_site)))
        for dpi in range(dp_site):
            for tp in range(tp_site):
                groups["pp"].append(tuple(r(tp, dpi, p, site) for p in range(pp_site)))
                stages = sorted({0, pp_site - 1})
                groups["embedding"].append(tuple(r(tp, dpi, p, site) for p in stages))
            groups["model_parallel"].append(tuple(
                r(t, dpi, p, site) for p in range(pp_site) for t in range(tp_site)))
        groups["site"].append(tuple(
            r(t, d, p, site) for p in range(pp_site) for d in range(dp_site) for t in range(tp_site)))
    lanes = dims.lanes
    if dims.site_tp:  # lane j of the canonical form: site-local rank j // (L / R_s) on every site
        groups["dp_inter"] = [tuple(dims.site_start(s) + lane // (lanes // dims.ranks_of_site(s))
                                    for s in range(dims.sites)) for lane in range(lanes)]
        groups["last_stages"] = [tuple(r(t, d, dims.pp_of(s) - 1, s) for s in range(dims.sites)
                                       for d in range(dims.dp_of(s)) for t in range(dims.tp_of(s)))]
        return groups
    for pp in range(dims.pp):
        for tp in range(dims.tp):
            groups["dp"].append(tuple(
                r(tp, d, pp, s) for s in range(dims.sites) for d in range(dims.dp_of(s))))
            for lane in range(lanes):  # equal sites: lane j = dp_intra rank j on every site
                groups["dp_inter"].append(tuple(
                    r(tp, lane // (lanes // dims.dp_of(s)), pp, s) for s in range(dims.sites)))
    return groups


@dataclass
class ProcessGroups:
    """The groups this rank belongs to, plus its coordinates and pipeline neighbours.

    - tp: tensor-parallel peers; pp: pipeline stages; dp: all data-parallel replicas;
    - dp_intra: replicas inside this site (gradients reduced and ZeRO-1 sharded here);
    - dp_inter: same (tp, pp, dp_intra) coordinate on every site (what crosses sites); with
      sites of different DP sizes, the first of this rank's lanes (`inter_lanes`: every one);
    - model_parallel: tp x pp (for global norms); embedding: first and last stage (tied
      word embeddings); site: every rank of this site (cheap intra-site agreement).
    Sites of different layouts: `dims` is this site's view (`ParallelDims.for_site`), dp is
    None, dp_inter and inter_lanes are lanes of the canonical form (module docstring).
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
    last_stages: Optional[dist.ProcessGroup] = None  # sites of different layouts only (module docstring)
    group_ranks: Dict[str, Tuple[int, ...]] = field(default_factory=dict)
    inter_site_backend: Optional[str] = None  # dp_inter's backend when it differs from the world's
    # The global rank of the torch.distributed world's rank 0: 0, or the site's first rank when
    # each site is a world of its own (fault tolerance: no group crosses sites, dp and
    # dp_inter are None and cross-site traffic goes through the torchft group).
    world_offset: int = 0
    # (lane, dp_inter group) for every lane this rank holds, in lane order (module docstring);
    # one entry, (dp_intra rank, dp_inter), when the sites are equal.
    inter_lanes: List[Tuple[int, Optional[dist.ProcessGroup]]] = field(default_factory=list)

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
    def dp_intra_size(self) -> int:
        """This site's data-parallel size (the same on every site unless --site-data-parallel-sizes)."""
        return self.dims.dp_of(self.coords.site)

    @property
    def dp_rank(self) -> int:
        """Index among all data-parallel replicas (site-major), used to pick samples."""
        return self.dims.dp_offset(self.coords.site) + self.coords.dp_intra

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
    if only_site is not None and dims.mixed_layouts:
        raise ValueError("sites of different layouts cannot each be a world of their own yet")
    # (sites of different sizes each a world of their own: their lane groups are torchft's, fault_tolerance/lanes.py)
    expected = dims.world_size if only_site is None else dims.ranks_of_site(only_site)
    if world != expected:
        raise ValueError(f"parallel layout {dims} needs {expected} ranks {'per site ' if only_site is not None else ''}"
                         f"but the world has {world}")
    offset = 0 if only_site is None else dims.site_start(only_site)
    rank = dist.get_rank() + offset
    coords = dims.coords(rank)
    pgs = ProcessGroups(dims=dims.for_site(coords.site), rank=rank, coords=coords,
                        inter_site_backend=inter_site_backend, world_offset=offset)
    # the index by which this rank holds lanes: its replica, or its place in the site (layouts differ)
    holder = rank - dims.site_start(coords.site) if dims.mixed_layouts else coords.dp_intra
    kwargs = {"timeout": timeout} if timeout is not None else {}
    for kind, all_ranks in enumerate_group_ranks(dims).items():
        seen = set()
        backend = {"backend": inter_site_backend} if kind == "dp_inter" and inter_site_backend else {}
        for ranks in all_ranks:
            # pp == 1: embedding group {0} == {pp-1}; create each once (but every lane: with
            # DP sizes like 2 and 3 two lanes can join the same ranks, each is still its own)
            if ranks in seen and kind != "dp_inter":
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
                if kind == "dp_inter":  # in lane order; the first is the rank's dp_inter
                    lane = len(pgs.inter_lanes)
                    pgs.inter_lanes.append((dims.lanes_of(coords.site, holder)[lane], group))
                    if lane:
                        continue
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
