"""Learning-rate schedule: linear warmup from 0, then constant / linear / cosine decay to
min_lr over lr_decay_iters (Megatron's OptimizerParamScheduler semantics)."""

from __future__ import annotations

import math

from megatron_lsgd.core.optimizer.config import OptimizerConfig


class LRScheduler:
    def __init__(self, config: OptimizerConfig):
        self.config = config
        self.num_steps = 0

    def lr_at(self, step: int) -> float:
        c = self.config
        if c.lr_warmup_iters > 0 and step <= c.lr_warmup_iters:
            return c.lr * step / c.lr_warmup_iters
        if c.lr_decay_style == "constant":
            return c.lr
        if step > c.lr_decay_iters:
            return c.min_lr
        span = c.lr_decay_iters - c.lr_warmup_iters
        ratio = (step - c.lr_warmup_iters) / span if span > 0 else 1.0
        if c.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return c.min_lr + coeff * (c.lr - c.min_lr)

    def next_lr(self) -> float:
        """LR for the coming update (the schedule advances only on successful updates)."""
        return self.lr_at(self.num_steps + 1)

    def step(self) -> None:
        self.num_steps += 1

    @property
    def current_lr(self) -> float:
        return self.lr_at(max(self.num_steps, 1))

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = int(state["num_steps"])
