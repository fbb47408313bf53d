"""Learning-rate schedule: linear warmup from 0, then constant / linear / cosine decay to
min_lr over lr_decay_iters (Megatron's OptimizerParamScheduler semantics).

The schedule counts iterations, or samples when `config.lr_unit == "samples"` (Megatron's
sample-based schedule: each successful step advances it by that step's global batch, so
warmup and decay spans are in samples and a growing batch size moves it faster). With a
constant batch g, a sample schedule with spans W·g and D·g gives exactly the learning
rates of the iteration schedule with spans W and D (each ratio is the same quotient of
integers, rounded once).

`--decoupled-lr` / `--decoupled-min-lr`: the embedding and output layer follow the same
shape between their own bounds (`next_lrs()["decoupled"]`).
"""

from __future__ import annotations

import math
from typing import Dict, Optional

from megatron_lsgd.core.optimizer.config import OptimizerConfig


class LRScheduler:
    def __init__(self, config: OptimizerConfig):
        self.config = config
        self.by_samples = config.lr_unit == "samples"
        self.num_steps = 0  # iterations, or samples with by_samples
        self._last_increment = 1

    def lr_at(self, step: float, max_lr: Optional[float] = None, min_lr: Optional[float] = None) -> float:
        c = self.config
        max_lr = c.lr if max_lr is None else max_lr
        min_lr = c.min_lr if min_lr is None else min_lr
        if c.lr_warmup_iters > 0 and step <= c.lr_warmup_iters:
            return max_lr * (step / c.lr_warmup_iters)  # the ratio first: the same quotient in either unit
        if c.lr_decay_style == "constant":
            return max_lr
        if step > c.lr_decay_iters:
            return min_lr
        span = c.lr_decay_iters - c.lr_warmup_iters
        ratio = (step - c.lr_warmup_iters) / span if span > 0 else 1.0
        if c.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return min_lr + coeff * (max_lr - min_lr)

    def _increment(self, samples: Optional[int]) -> int:
        if not self.by_samples:
            return 1
        if not samples or samples < 1:
            raise ValueError("a sample-based learning-rate schedule needs the step's number of samples")
        return samples

    def next_lr(self, samples: Optional[int] = None) -> float:
        """LR for the coming update (the schedule advances only on successful updates).
        `samples`: the step's global batch (needed when the schedule counts samples)."""
        return self.lr_at(self.num_steps + self._increment(samples))

    def next_lrs(self, samples: Optional[int] = None) -> Dict[str, float]:
        """{"default": lr, "decoupled": lr of the embedding and output layer} for the coming update."""
        at = self.num_steps + self._increment(samples)
        lrs = {"default": self.lr_at(at)}
        c = self.config
        if c.decoupled_lr is not None:
            lrs["decoupled"] = self.lr_at(at, c.decoupled_lr, c.decoupled_min_lr)
        return lrs

    def step(self, samples: Optional[int] = None) -> None:
        self._last_increment = self._increment(samples)
        self.num_steps += self._last_increment

    @property
    def current_lr(self) -> float:
        return self.lr_at(max(self.num_steps, self._last_increment))

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "unit": self.config.lr_unit}

    def load_state_dict(self, state: dict) -> None:
        unit = state.get("unit", "iterations")
        if unit != self.config.lr_unit:
            raise ValueError(f"the saved learning-rate schedule counts {unit}, this run's counts "
                             f"{self.config.lr_unit} (set by --train-samples/--train-tokens, --lr-*-samples or a "
                             f"batch-size schedule); keep the same flags or pass --no-load-optim")
        self.num_steps = int(state["num_steps"])
