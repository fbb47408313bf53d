"""Simulated stragglers (`--simulate-slow-ranks`) for heterogeneity experiments.

A chosen rank sleeps (factor - 1) x its own measured forward-backward time after each
forward-backward, so it computes `factor` times slower while computing exactly the same
numbers. Only compute is slowed: the time the block spent waiting for inter-site
communication (an algorithm that syncs layer by layer inside the forward pass, EDiT, waits
there; the clock counts the block's waits, `Clock.counting_waits`) is left out of the
measured time, so a slow rank does not also wait (factor - 1) x longer for the network.
Time is the run's clock (core/clock.py): under --simulate-clock the measured time is the
charged compute and the sleep advances virtual time, so a slow rank's compute
costs `factor` times as much. In `consistent` mode the chosen ranks are slow every step (EDiT's consistent
straggler, ACCO's heterogeneous workers); in `random` mode each chosen rank is slow on a
step with probability `--slow-probability`, drawn from a generator seeded by (seed, step,
rank) so a run can be repeated exactly and does not depend on timing.

The measured time is the schedule call's time less those waits, so with PP > 1 it still
includes waiting for neighbouring stages (pipeline point-to-point is not an inter-site wait).
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

from megatron_lsgd.core.clock import Clock

SLOW_MODES = ("consistent", "random")


def parse_rank_list(text: Optional[str]) -> Tuple[int, ...]:
    """'1,3' -> (1, 3); '' or None -> (). Raises ValueError naming the flag."""
    if not text:
        return ()
    try:
        ranks = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise ValueError(f"--simulate-slow-ranks {text!r}: expected comma-separated global ranks, e.g. 1,3") from None
    return ranks


@dataclass(frozen=True)
class StragglerConfig:
    ranks: Tuple[int, ...] = ()
    factor: float = 2.0
    mode: str = "consistent"
    probability: float = 0.5
    seed: int = 1234

    @classmethod
    def from_args(cls, args) -> "StragglerConfig":
        """From the parsed flags (missing flags, e.g. a hand-built namespace, mean no stragglers)."""
        if args is None:
            return cls()
        return cls(ranks=parse_rank_list(getattr(args, "simulate_slow_ranks", None)),
                   factor=getattr(args, "slow_factor", 2.0), mode=getattr(args, "slow_mode", "consistent"),
                   probability=getattr(args, "slow_probability", 0.5), seed=getattr(args, "seed", 1234))

    def validate(self, world_size: int) -> None:
        bad = [r for r in self.ranks if r < 0 or r >= world_size]
        if bad:
            raise ValueError(f"--simulate-slow-ranks {','.join(map(str, bad))}: ranks must be in 0..{world_size - 1}")
        if self.factor < 1.0:
            raise ValueError(f"--slow-factor {self.factor} must be >= 1 (1: not slowed)")
        if self.mode not in SLOW_MODES:
            raise ValueError(f"--slow-mode {self.mode!r}: choose one of {', '.join(SLOW_MODES)}")
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"--slow-probability {self.probability} must be in [0, 1]")


class Straggler:
    """Slows this rank (or does nothing when it is not chosen)."""

    def __init__(self, config: StragglerConfig, rank: int, clock: Clock):
        self.config = config
        self.rank = rank
        self.enabled = rank in config.ranks and config.factor > 1.0
        self.slept_seconds = 0.0
        self._clock = clock

    def is_slow(self, iteration: int) -> bool:
        if not self.enabled:
            return False
        if self.config.mode == "consistent":
            return True
        # An integer seed keeps the draw identical across processes and Python hash seeds.
        rng = random.Random((self.config.seed * 1_000_003 + iteration) * 65_537 + self.rank)
        return rng.random() < self.config.probability

    def delay_for(self, compute_seconds: float, iteration: int) -> float:
        return (self.config.factor - 1.0) * compute_seconds if self.is_slow(iteration) else 0.0

    @contextmanager
    def around_compute(self, iteration: int) -> Iterator[None]:
        """Time the block's compute (its time less its waits for communication), then sleep
        so that compute took `factor` times as long."""
        if not self.enabled:
            yield
            return
        clock = self._clock
        start = clock.now()
        with clock.counting_waits() as waits:
            yield
        elapsed = clock.now() - start  # (now() drains a GPU's stream: the wait marks are done)
        compute = max(elapsed - clock.waited_seconds(waits), 0.0)
        delay = self.delay_for(compute, iteration)
        if delay > 0:
            self._clock.sleep(delay)
            self.slept_seconds += delay
