"""The split of a site's cross-site traffic over its DP_intra ranks (`SiteSplit`,
`gather_parts`) and the blocking mean of gradients across sites built on it
(`average_grads_across_sites`: every local-SGD algorithm's synchronous warm-up; its
cross-site part, `mean_grads_across_sites`, is the `sync` algorithm's step)."""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch

from megatron_lsgd.core.distributed.collectives import all_gather_flat
from megatron_lsgd.core.lsgd.canonical_exchange import CanonicalExchange
from megatron_lsgd.core.lsgd.compressors import Compressor, CompressorBank
from megatron_lsgd.core.lsgd.means import SideValues, fp32_mean
from megatron_lsgd.core.lsgd.protocol import SyncContext
from megatron_lsgd.core.lsgd.reduction import Reduction, run_blocking


class SiteSplit:
    """Who sends what across sites when every rank of a site holds the same copy.

    Without ZeRO-1 the DP_intra ranks of a site hold identical, already site-reduced
    gradients and parameters. Each then exchanges across sites only its 1/DP_intra part of
    any fragment (`mine`: ShardViews.part) and the site puts the parts back together
    (`gather`: one all-gather over dp_intra), so a site's WAN bytes are spread over its
    DP_intra links, as ZeRO-1's shards spread them. Under ZeRO-1 (or with DP_intra = 1)
    the shards already split the traffic and both are identities. Every synchronizer that
    sends something across sites goes through this.

    Sites of different data-parallel sizes (--site-data-parallel-sizes): what a rank sends
    (its shard, or its part) is cut further into the lanes it holds (parallel_state: L =
    lcm of the sites' DP sizes, buckets padded to a multiple of L), each exchanged on its
    lane's dp_inter group (`lanes_of`, `mean`), so both sides of every group hold the same
    range of every bucket although their shards differ. A site's traffic is still spread
    over its ranks and nothing is gathered on one rank. The comm weights every mean by the
    site's share of the round's tokens (InterSiteComm.site_weight). With `shard_sizes` given,
    any part of the model (a fragment's units, the whole shard) is cut at the lanes' places in
    its buckets, which are the same on every site (`mine`, `lane_cuts`, `gather_views`), for
    means that overlap inner steps on lane groups of their own (`on_lanes`): exact with side
    values riding along (`lane_mean`: streaming-diloco, cocodc), or by a reducer per lane
    (`lane_compressors`, `lane_reduce`: the DiLoCo family's compressed means); `square_norm` sums a norm
    over such cuts in one order on every site (cocodc's choice of fragment)."""

    def __init__(self, pgs, sharded: bool, shard_sizes: Optional[List[int]] = None):
        self.pgs = pgs
        self.parts = pgs.dp_intra_size
        self.index = pgs.dp_intra_rank
        self.group = pgs.dp_intra
        self.active = self.parts > 1 and not sharded
        # [dp_inter group of each lane this rank holds]; empty when the sites are equal
        # (sites of different layouts: their lanes are the canonical form's, CanonicalExchange's)
        self.lanes = [group for _, group in pgs.inter_lanes] \
            if pgs.dims.heterogeneous and not pgs.dims.mixed_layouts else []
        self.lane_ids = [lane for lane, _ in pgs.inter_lanes] if self.lanes else []
        # the size of each main shard (a whole bucket without ZeRO-1): where its lanes lie
        self.shard_sizes = shard_sizes

    def on_lanes(self, groups: Sequence) -> None:
        """Run the lanes' means on `groups` instead: fresh clones of this rank's lane groups, in
        lane order (comm.use_dedicated_group), for means that overlap inner steps."""
        if self.lanes:
            if len(groups) != len(self.lanes):
                raise RuntimeError(f"{len(groups)} dedicated groups for this rank's {len(self.lanes)} lanes")
            self.lanes = list(groups)

    def _block(self, shard: int) -> Tuple[int, int]:
        """Where this rank's lanes lie in main shard `shard` (its coordinates): the whole shard
        under ZeRO-1, else the rank's DP_s-th of the bucket (a multiple of L: exact)."""
        n = self.shard_sizes[shard]
        return (self.index * n // self.parts, (self.index + 1) * n // self.parts) if self.active else (0, n)

    def lane_cuts(self, views) -> List[Tuple[object, List[Tuple[int, int, int]]]]:
        """Per lane this rank holds: (its dp_inter group, [(range index, lo, hi) of `views` (this
        rank's part, `mine`) inside the lane]). A lane is the same range of every bucket on every
        site and a fragment the same units, so both ends of a lane's group cut the same values."""
        k = len(self.lanes)
        cuts: List[Tuple[object, List[Tuple[int, int, int]]]] = [(group, []) for group in self.lanes]
        for i, r in enumerate(views.ranges):
            b_lo, b_hi = self._block(r.shard)
            width = (b_hi - b_lo) // k
            for j in range(k):
                lo, hi = max(r.lo, b_lo + j * width), min(r.hi, b_lo + (j + 1) * width)
                if lo < hi:
                    cuts[j][1].append((i, lo - r.lo, hi - r.lo))
        return cuts

    def lane_mean(self, comm, views, tensors: List[torch.Tensor], device: torch.device,
                  side: Optional[SideValues] = None) -> Reduction:
        """The weighted mean across sites of `tensors` (one per range of `views`, this rank's
        part), every lane at once on its group, as a reduction (it may overlap inner steps);
        a lane without values is skipped on both its ends. `side` rides in every lane (a
        site's ranks send the same values, so every lane returns the same mean). Returns the
        means in fp32, laid out like `tensors`."""
        cuts, sent = self.lane_cuts(views), []
        for group, pieces in cuts:
            if not pieces and side is None:
                sent.append(None)
                continue
            flat = [tensors[i][lo:hi].to(device, torch.float32) for i, lo, hi in pieces]
            if side is not None:
                flat.append(side.values.to(device))
            buf = torch.cat(flat)
            with comm.on_group(group):
                sent.append((buf, comm.all_reduce_mean(buf, async_op=True)))
        for item in sent:
            if item is not None:
                yield item[1]
        out = [torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in tensors]
        for (_, pieces), item in zip(cuts, sent):
            if item is None:
                continue
            offset = 0
            for i, lo, hi in pieces:
                out[i][lo:hi] = item[0][offset:offset + hi - lo]
                offset += hi - lo
            if side is not None and side.mean is None:
                side.mean = item[0][offset:].clone()
        return out

    def lanes_of(self, tensors) -> List[Tuple[object, List[torch.Tensor]]]:
        """`tensors` (the ranges of `mine`) cut into this rank's lanes: [(lane's dp_inter group,
        [consecutive 1/lanes of each tensor, as views])]; [(None, tensors)] when the sites are
        equal (None: the comm's own group)."""
        if not self.lanes:
            return [(None, list(tensors))]
        k = len(self.lanes)
        for t in tensors:
            if t.numel() % k:
                raise ValueError(f"a range of {t.numel()} values cannot be cut into {k} lanes: buckets must be "
                                 f"padded to the lanes (DistributedDataParallel does this for whole shards)")
        return [(group, [t.reshape(-1)[j * (t.numel() // k):(j + 1) * (t.numel() // k)] for t in tensors])
                for j, group in enumerate(self.lanes)]

    def mean(self, comm, tensors, reduce: Callable[[List[torch.Tensor]], List[torch.Tensor]]
             ) -> List[torch.Tensor]:
        """The mean across sites of `tensors` (this rank's part): `reduce(tensors)` -> means,
        run on `comm` once (sites equal) or once per lane on the lane's group, the lanes'
        means put back together in the tensors' shapes."""
        if not self.lanes:
            return reduce(tensors)
        out = [torch.empty_like(t) for t in tensors]
        for (group, chunks), (_, dests) in zip(self.lanes_of(tensors), self.lanes_of(out)):
            with comm.on_group(group):
                means = reduce(chunks)
            for dest, m in zip(dests, means):
                dest.copy_(m.reshape(-1))
        return out

    def lane_views(self, views) -> List[object]:
        """`views` (this rank's part) cut into its lanes, one ShardViews per lane, named by the
        lane (the same key on both ends of its group): what a compressor per lane is built on,
        so both ends quantize the same values in the same blocks, with their own error feedback."""
        out = []
        for lane, (_, pieces) in zip(self.lane_ids, self.lane_cuts(views)):
            bounds = [(r.lo, r.lo) for r in views.ranges]  # nothing of a range outside the lane
            for i, lo, hi in pieces:
                bounds[i] = (views.ranges[i].lo + lo, views.ranges[i].lo + hi)
            out.append(views.clip(bounds, self.index, self.parts,
                                  key=f"{views.fragment}/lane{lane}of{self.pgs.dims.lanes}"))
        return out

    def lane_compressors(self, bank: CompressorBank, views, device: torch.device, comm) -> List[Compressor]:
        """A compressor per lane this rank holds of `views` (built on `lane_views`: its own
        blocks and error feedback, the same values on both ends of the lane), each site's
        contribution scaled by its weight x S, so that the plain mean of the compressed values
        is the mean weighted by tokens: `lane_reduce`'s reducers. Empty when the sites are equal."""
        compressors = [bank.for_views(v, device) for v in self.lane_views(views)] if self.lanes else []
        for compressor in compressors:
            if compressor.kind != "none":
                compressor.contribution_scale = comm.site_weight * comm.num_sites
        return compressors

    def lane_reduce(self, comm, views, tensors: List[torch.Tensor],
                    reducers: Sequence[Callable[[List[torch.Tensor]], Reduction]],
                    side: Optional[SideValues] = None, device: Optional[torch.device] = None) -> Reduction:
        """The mean across sites of `tensors` (laid out like `views`), each lane by its own
        reducer (a compressor's `reduce` over `lane_views`' tensors) on the lane's group, the
        lanes' phases issued side by side; returns the means laid out like `tensors`. Weighting
        is the reducer's (the comm's weight for an exact mean, the compressor's
        contribution_scale for a compressed one). `side` (on `device`) is averaged exactly and
        weighted, as `lane_mean` does, in a collective of its own on every lane, also one with
        none of `views`: every lane gives the same mean, whatever its reducer."""
        cuts, lanes = self.lane_cuts(views), []
        for (group, pieces), reduce in zip(cuts, reducers):
            lane = {"group": group, "pieces": pieces, "handle": None, "result": []}
            if pieces:
                lane["gen"] = reduce([tensors[i][lo:hi] for i, lo, hi in pieces])
                self._advance(comm, lane, first=True)
            lanes.append(lane)
        for group, _ in (cuts if side is not None else []):
            # issued after every lane's first phase, and a lane's next phases only after the
            # loop below waits for its first: one order on each group, on both its ends
            lane = {"group": group, "pieces": [], "handle": None, "result": [],
                    "gen": fp32_mean(comm, torch.zeros(0, device=device), side)}
            self._advance(comm, lane, first=True)
            lanes.append(lane)
        while any(lane["handle"] is not None for lane in lanes):
            for lane in lanes:
                if lane["handle"] is not None:
                    yield lane["handle"]
                    self._advance(comm, lane, first=False)
        out = [torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in tensors]
        for lane in lanes:
            for (i, lo, hi), mean in zip(lane["pieces"], lane["result"]):
                out[i][lo:hi] = mean.reshape(-1)
        return out

    @staticmethod
    def _advance(comm, lane, first: bool) -> None:
        """Run a lane's reduction up to its next collective, issued on the lane's group."""
        with comm.on_group(lane["group"]):
            try:
                lane["handle"] = next(lane["gen"]) if first else lane["gen"].send(None)
            except StopIteration as stop:
                lane["handle"], lane["result"] = None, stop.value

    def square_norm(self, views, tensors: List[torch.Tensor], spans, device: torch.device) -> float:
        """The sum of squares over the site of `tensors` (laid out like `views`, this rank's
        part) on `spans` (optimizer.counted_spans: each value of the model once), the same float
        on every rank of every site when every site holds the same tensors: each lane is summed
        piece by piece in bucket order, its (tp, pp) holders' sums in one order and the lanes
        in lane order, as the sites' shards differ (a collective over the site)."""
        lanes, dims, pgs = self.pgs.dims.lanes, self.pgs.dims, self.pgs
        local = [0.0] * lanes
        counted = {}
        for r, lo, hi in spans:
            counted.setdefault(r, []).append((lo, hi))
        for lane, (_, pieces) in zip(self.lane_ids, self.lane_cuts(views)):
            cut = [(i, max(lo, a), min(hi, b)) for i, lo, hi in pieces for a, b in counted.get(i, [])
                   if max(lo, a) < min(hi, b)]
            norms = [torch.linalg.vector_norm(tensors[i][a:b], dtype=torch.float64) for i, a, b in sorted(cut)]
            for norm in torch.stack(norms).tolist() if norms else []:
                local[lane] += norm ** 2
        site = pgs.site_rank
        ranks = dims.ranks_of_site(site)
        mine = torch.tensor(local, dtype=torch.float64, device=device)
        rows = [local]
        if ranks > 1:
            gathered = torch.empty(ranks * lanes, dtype=torch.float64, device=device)
            all_gather_flat(gathered, mine, group=pgs.site)
            rows = gathered.view(ranks, lanes).tolist()
        start, per = dims.site_start(site), lanes // dims.dp_of(site)
        total = 0.0
        for lane in range(lanes):
            for pp in range(dims.pp):
                for tp in range(dims.tp):
                    total += rows[dims.rank_of(tp, lane // per, pp, site) - start][lane]
        return total

    def mine(self, views):
        """The part of `views` this rank sends across sites (at the lanes' places when the
        shard sizes are known)."""
        if not self.active:
            return views
        if self.lanes and self.shard_sizes is not None:
            return views.clip([self._block(r.shard) for r in views.ranges], self.index, self.parts)
        return views.part(self.index, self.parts)

    def gather(self, tensors, group=None) -> None:
        """Every rank of the site gets every rank's part of `tensors` (whole ranges)."""
        if self.active and tensors:
            gather_parts(tensors, self.parts, self.index, self.group if group is None else group)

    def gather_views(self, views) -> None:
        """`gather` of `views`' main tensors, as `mine` cut them (at the lanes' places when the
        shard sizes are known)."""
        if not (self.active and views.main):
            return
        if not (self.lanes and self.shard_sizes is not None):
            return self.gather(views.main)
        bounds = []
        for r in views.ranges:
            n = self.shard_sizes[r.shard]
            blocks = [(q * n // self.parts, (q + 1) * n // self.parts) for q in range(self.parts)]
            bounds.append([(min(max(lo, r.lo), r.hi) - r.lo, max(min(hi, r.hi), r.lo) - r.lo) for lo, hi in blocks])
        gather_parts(views.main, self.parts, self.index, self.group, bounds)


def gather_parts(tensors, parts: int, index: int, group, bounds=None) -> None:
    """Inverse of ShardViews.part inside the site: every rank contributes its part of each
    tensor (padded to the ceil-sized chunk), one all-gather, everyone copies the whole back.
    Shared by every synchronizer that splits a site's cross-site traffic over its DP_intra
    ranks without ZeRO-1 (sync, edit, acco, dreamddp). `bounds[t][q]`: rank q's (lo, hi) of
    tensor t instead (ShardViews.clip's parts; each padded to the largest)."""
    if bounds is None:  # equal parts (the last ones shorter or empty)
        bounds = []
        for t in tensors:
            chunk = -(-t.numel() // parts)
            bounds.append([(min(t.numel(), q * chunk), min(t.numel(), (q + 1) * chunk)) for q in range(parts)])
    chunks = [max(hi - lo for lo, hi in b) for b in bounds]
    send = torch.zeros(sum(chunks), dtype=tensors[0].dtype, device=tensors[0].device)
    offset = 0
    for t, b, chunk in zip(tensors, bounds, chunks):
        lo, hi = b[index]
        send[offset:offset + hi - lo] = t[lo:hi]
        offset += chunk
    recv = torch.empty(parts * send.numel(), dtype=send.dtype, device=send.device)
    all_gather_flat(recv, send, group=group)
    whole = recv.view(parts, -1)
    offset = 0
    for t, b, chunk in zip(tensors, bounds, chunks):
        for q, (lo, hi) in enumerate(b):
            t[lo:hi] = whole[q, offset:offset + hi - lo]
        offset += chunk


def average_grads_across_sites(ctx: SyncContext, compressors: Optional[CompressorBank] = None,
                               exchange: Optional[CanonicalExchange] = None) -> None:
    """Blocking mean of this rank's gradient shards over dp_inter (also used for the
    synchronous warm-up steps of the local-SGD algorithms, always uncompressed).

    Under ZeRO-1 each rank owns a different shard, so the site's traffic is already split
    over its DP_intra links. Without ZeRO-1 every rank of the site holds the same, already
    reduced, full gradient: each then averages only its 1/DP_intra part across sites and
    the site all-gathers the parts, instead of every rank sending everything. Sites of
    different sizes: the mean is weighted by each site's tokens, lane by lane (SiteSplit).
    Sites of different layouts: through `exchange`, in the layout-free form (uncompressed)."""
    comm = ctx.comm
    if comm.num_sites == 1:
        return
    views = ctx.optimizer.views()
    split = SiteSplit(ctx.pgs, ctx.optimizer.sharded)
    mean_grads_across_sites(comm, split, split.mine(views), compressors, exchange)
    split.gather(views.grad)
    comm.rounds += 1


def mean_grads_across_sites(comm, split: SiteSplit, mine, compressors: Optional[CompressorBank] = None,
                            exchange: Optional[CanonicalExchange] = None) -> None:
    """The cross-site part of `average_grads_across_sites`: this rank's part of the gradients
    (`mine`) becomes its mean across sites, in place; nothing inside the site (an elastic
    `sync` step runs this under its quorum, where it may fail, and gathers in the site after)."""
    if exchange is not None:
        for grad, mean in zip(mine.grad, exchange.mean(comm, mine, mine.grad)):
            grad.copy_(mean)
    elif compressors is None:
        handles = []
        for group, grads in split.lanes_of(mine.grad):
            with comm.on_group(group):
                handles += [comm.all_reduce_mean(grad, async_op=True) for grad in grads]
        for h in handles:
            h.wait()
    elif mine.ranges:  # every rank of a dp_inter group has the same part index: all skip together
        compressor = compressors.for_views(mine, mine.grad[0].device)
        means = split.mean(comm, mine.grad, lambda grads: run_blocking(compressor.reduce(grads)))
        for grad, mean in zip(mine.grad, means):
            grad.copy_(mean)
