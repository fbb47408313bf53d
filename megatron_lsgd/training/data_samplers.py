"""Which samples each data-parallel rank reads: Megatron's order, one stream per site.

A global batch is cut into chunks of micro_batch x DP consecutive sample indices
(DP = DP_intra x S); inside a chunk, site s owns the DP_intra micro-batches
[s DP_intra mb, (s+1) DP_intra mb), and its DP_intra rank r the r-th of those. So every
layout reads the same micro-batches per global batch as one rank would, which is what
makes DP/site layouts equivalent.

With sites of different data-parallel sizes (--site-data-parallel-sizes) the chunk is
micro_batch x (DP_0 + ... + DP_{S-1}) and site s owns its DP_s micro-batches after those
of the sites before it: each global data-parallel index reads what it reads in one
data-parallel group of that size, so a site's share of every global batch is DP_s / DP.

Each site walks only its own column of that grid, counting its own consumed samples. Sites
that advance together (every lockstep algorithm) read exactly Megatron's global order;
sites that run at different speeds (A-EDiT, ACCO's variable micro-batch counts) never read
the same sample, and each resumes from its own count.
"""

from __future__ import annotations

from typing import Iterator, List, Optional, Sequence

import torch


class SiteSampler:
    def __init__(self, total_samples: int, site_consumed: int, micro_batch_size: int, site: int, sites: int,
                 dp_intra_rank: int, dp_intra: int, site_sizes: Optional[Sequence[int]] = None):
        """`site_sizes`: every site's DP size when they differ (then `dp_intra` is this site's)."""
        sizes = list(site_sizes) if site_sizes else [dp_intra] * sites
        self.site_chunk = micro_batch_size * dp_intra  # one micro-batch per rank of the site
        self.chunk = micro_batch_size * sum(sizes)
        if site_consumed % self.site_chunk:
            raise ValueError(f"site consumed samples {site_consumed} is not a multiple of micro batch x "
                             f"data-parallel ranks per site ({self.site_chunk})")
        if site_consumed // self.site_chunk * self.chunk > total_samples:
            raise ValueError(f"consumed samples {site_consumed} (this site) exceed the dataset's share "
                             f"{total_samples // self.chunk * self.site_chunk}")
        self.total = total_samples
        self.consumed = site_consumed
        self.mb = micro_batch_size
        self.offset = (sum(sizes[:site]) + dp_intra_rank) * micro_batch_size

    def __len__(self) -> int:
        return self.total // self.chunk - self.consumed // self.site_chunk

    def __iter__(self) -> Iterator[List[int]]:
        for c in range(self.consumed // self.site_chunk, self.total // self.chunk):
            lo = c * self.chunk + self.offset
            yield list(range(lo, lo + self.mb))


def build_data_iterator(dataset, site_consumed: int, micro_batch_size: int, pgs, num_workers: int = 0,
                        cyclic: bool = False):
    """An iterator of this rank's micro-batches, starting after `site_consumed` samples of
    its site's stream. A cyclic iterator (validation) restarts from the beginning whenever
    the dataset is exhausted; `site_consumed` is then a position in that endless stream, so
    a resumed run evaluates on the samples the uninterrupted run would have."""
    if dataset is None:
        return None
    dims = pgs.dims

    def make_loader(consumed):
        sampler = SiteSampler(len(dataset), consumed, micro_batch_size, pgs.site_rank, dims.sites, pgs.dp_intra_rank,
                              pgs.dp_intra_size, dims.site_dp or None)
        return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                           pin_memory=torch.cuda.is_available(),
                                           persistent_workers=num_workers > 0)

    if not cyclic:
        return iter(make_loader(site_consumed))

    site_chunk = micro_batch_size * pgs.dp_intra_size
    per_pass = len(dataset) // (micro_batch_size * dims.dp) * site_chunk  # this site's samples per pass
    start = site_consumed % per_pass if per_pass else 0

    def forever():
        yield from make_loader(start)
        while True:
            yield from make_loader(0)
    return forever()
