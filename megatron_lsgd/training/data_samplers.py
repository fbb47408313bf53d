"""Which samples each data-parallel rank reads, Megatron style.

A global batch is cut into chunks of micro_batch x DP consecutive sample indices; DP rank
r takes the r-th micro-batch of each chunk. The set of micro-batches per global batch is
therefore the same for every layout, which makes DP/site layouts equivalent to one rank.
"""

from __future__ import annotations

from typing import Iterator, List

import torch


class PretrainingSampler:
    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int):
        if consumed_samples > total_samples:
            raise ValueError(f"consumed samples {consumed_samples} exceed the dataset's {total_samples}")
        self.total = total_samples
        self.consumed = consumed_samples
        self.mb = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size

    def __len__(self) -> int:
        return (self.total - self.consumed) // (self.mb * self.dp_size)

    def __iter__(self) -> Iterator[List[int]]:
        chunk = self.mb * self.dp_size
        for start in range(self.consumed, self.total - chunk + 1, chunk):
            lo = start + self.dp_rank * self.mb
            yield list(range(lo, lo + self.mb))


def build_data_iterator(dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                        num_workers: int = 0, cyclic: bool = False):
    if dataset is None:
        return None

    def make_loader(consumed):
        sampler = PretrainingSampler(len(dataset), consumed, micro_batch_size, dp_rank, dp_size)
        return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                           pin_memory=torch.cuda.is_available(),
                                           persistent_workers=num_workers > 0)

    if not cyclic:
        return iter(make_loader(consumed_samples))

    def forever():
        while True:
            yield from make_loader(0)
    return forever()
