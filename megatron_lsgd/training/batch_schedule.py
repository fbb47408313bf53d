"""Global batch size as a function of the samples consumed so far (Megatron's batch-size
ramp-up and step schedules).

A schedule is a step function: (first consumed sample, global batch size) pairs, the
first at 0. `--rampup-batch-size START INCREMENT SAMPLES` is the special case of equal
steps: with n = (global batch - START) / INCREMENT increments, batch START + k INCREMENT
applies from ceil(k SAMPLES / n) samples on, and the full global batch after SAMPLES.
Every batch in the schedule must be a multiple of micro batch x data-parallel size, so a
step is always a whole number of micro-batches on every rank.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import List, Optional, Tuple

_SUFFIX = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def _count(text: str, flag: str) -> int:
    text = text.strip()
    scale = _SUFFIX.get(text[-1:].upper(), 1)
    number = text[:-1] if scale != 1 else text
    try:
        value = float(number) * scale
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a number (K, M, B, T suffixes allowed)") from None
    if value < 0 or value != int(value):
        raise ValueError(f"{flag}: {text!r} must be a non-negative whole number")
    return int(value)


@dataclass
class BatchSchedule:
    steps: List[Tuple[int, int]]  # (from this many consumed samples on, global batch size), ascending
    micro_batch_times_dp: int  # micro batch size x data-parallel size (all sites)
    flag: str = "--rampup-batch-size"

    def __post_init__(self):
        if not self.steps or self.steps[0][0] != 0:
            raise ValueError(f"{self.flag}: the schedule must start at 0 samples")
        for (a, _), (b, _) in zip(self.steps, self.steps[1:]):
            if b <= a:
                raise ValueError(f"{self.flag}: thresholds must increase ({a} then {b} samples)")
        for _, batch in self.steps:
            if batch < 1 or batch % self.micro_batch_times_dp:
                raise ValueError(f"{self.flag}: global batch size {batch} is not a positive multiple of micro batch "
                                 f"size x data-parallel size = {self.micro_batch_times_dp}")
        self._starts = [s for s, _ in self.steps]

    @classmethod
    def rampup(cls, start: int, increment: int, samples: int, global_batch: int,
               micro_batch_times_dp: int) -> "BatchSchedule":
        flag = "--rampup-batch-size"
        if start < 1 or increment < 1 or samples < 0:
            raise ValueError(f"{flag} {start} {increment} {samples}: START and INCREMENT must be >= 1, SAMPLES >= 0")
        if global_batch < start or (global_batch - start) % increment:
            raise ValueError(f"{flag} {start} {increment} {samples}: --global-batch-size {global_batch} must be "
                             f"START plus a whole number of INCREMENTs")
        n = (global_batch - start) // increment
        steps = [(0, start)]
        for k in range(1, n + 1):
            at = -(-k * samples // n)  # ceil(k * samples / n), exactly
            batch = start + k * increment
            if at > steps[-1][0]:
                steps.append((at, batch))
            else:  # a zero-length step (SAMPLES smaller than the increments): the larger batch wins
                steps[-1] = (steps[-1][0], batch)
        return cls(steps, micro_batch_times_dp, flag)

    @staticmethod
    def parse_steps(text: str, seq_length: Optional[int]) -> List[Tuple[int, int]]:
        """'0:16 2.4B:320 ...' -> [(samples, batch)]; thresholds count tokens when seq_length is given."""
        flag = "--step-batch-size-schedule"
        steps = []
        for entry in text.replace(",", " ").split():
            if ":" not in entry:
                raise ValueError(f"{flag}: {entry!r} is not THRESHOLD:BATCH_SIZE")
            threshold, batch = entry.split(":", 1)
            at = _count(threshold, flag)
            steps.append((at // seq_length if seq_length else at, _count(batch, flag)))
        if not steps:
            raise ValueError(f"{flag}: empty schedule")
        return sorted(steps)

    # ---- queries ----------------------------------------------------------------------------
    @property
    def final_global_batch_size(self) -> int:
        return self.steps[-1][1]

    def global_batch_size(self, consumed_samples: int) -> int:
        return self.steps[bisect.bisect_right(self._starts, consumed_samples) - 1][1]

    def num_microbatches(self, consumed_samples: int) -> int:
        return self.global_batch_size(consumed_samples) // self.micro_batch_times_dp

    def iterations_for(self, train_samples: int) -> int:
        """Steps whose batches fit entirely within `train_samples` (the constant-batch case
        gives train_samples // global batch)."""
        consumed = steps = 0
        for i, (start, batch) in enumerate(self.steps):
            end = self.steps[i + 1][0] if i + 1 < len(self.steps) else None
            if end is None:
                return steps + (train_samples - consumed) // batch
            while consumed < end:
                if consumed + batch > train_samples:
                    return steps
                consumed += batch
                steps += 1
        return steps
