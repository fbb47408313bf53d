"""`diloco`: H inner steps on each site, then a blocking fp32 mean of the outer gradient
Δ = θ_g - θ_local across sites and an outer Nesterov step on the anchor; every site
restarts from the new anchor (Douillard et al., DiLoCo; DESIGN.md §4.1).

Each rank handles only its own ZeRO-1 shard: the all-reduce runs on dp_inter, and the
site's all-gather in copy_main_to_model_params() spreads the result inside the site.
With one site there is nothing to average and the synchronizer does nothing, so S = 1 is
plain Megatron (DESIGN.md §3).
"""

from __future__ import annotations

import abc
from typing import Dict, List

import torch

from megatron_lsgd.core.lsgd.base import SyncContext, Synchronizer, register
from megatron_lsgd.core.lsgd.compression import fp32_mean, run_blocking
from megatron_lsgd.core.lsgd.outer_optimizer import OuterOptimizer
from megatron_lsgd.core.lsgd.sync import average_grads_across_sites


def split_like(flat: torch.Tensor, like: List[torch.Tensor]) -> List[torch.Tensor]:
    return list(flat.split([t.numel() for t in like]))


class LocalSGDBase(Synchronizer, abc.ABC):
    """Shared by the DiLoCo family: warm-up, anchors, round bookkeeping."""

    def __init__(self, ctx: SyncContext):
        super().__init__(ctx)
        cfg = ctx.config
        self.active = ctx.comm.num_sites > 1
        self.interval = cfg.interval
        self.steps_in_round = 0
        self.outer_rounds = 0
        self.outer = OuterOptimizer(ctx.optimizer.main_param_shards(), cfg.outer_lr, cfg.outer_momentum,
                                    cfg.outer_offload) if self.active else None

    def in_warmup(self, iteration: int) -> bool:
        return iteration < self.ctx.config.warmup_iters

    def after_forward_backward(self, iteration: int) -> None:
        if self.active and self.in_warmup(iteration):
            average_grads_across_sites(self.ctx)

    def after_optimizer_step(self, iteration: int, update_successful: bool) -> None:
        if not self.active:
            return
        if self.in_warmup(iteration):
            if iteration == self.ctx.config.warmup_iters - 1:  # local phase starts from here
                self.outer.reset_anchors(self.ctx.optimizer.main_param_shards())
            return
        # Skipped (fp16 overflow) steps count too: sites must agree on round boundaries.
        self.steps_in_round += 1
        if self.steps_in_round >= self.interval:
            self._close_round()

    def _close_round(self) -> None:
        self.steps_in_round = 0
        self.end_round()
        self.outer_rounds += 1
        self.ctx.comm.rounds += 1

    def finish_training(self, iteration: int) -> None:
        # A run whose length is not a multiple of H ends with a shorter last round, so the
        # final model is the averaged anchor rather than each site's own drift.
        if self.active and self.steps_in_round > 0:  # only counted after warm-up
            self._close_round()

    def restart_from_anchor(self) -> None:
        opt = self.ctx.optimizer
        self.outer.load_into(opt.main_param_shards())
        opt.copy_main_to_model_params()

    @abc.abstractmethod
    def end_round(self) -> None:
        """Called after the H-th inner step of a round: exchange and apply the outer step."""

    def _base_state(self) -> Dict:
        return {"steps_in_round": self.steps_in_round, "outer_rounds": self.outer_rounds,
                "interval": self.interval, "outer": self.outer.state_dict() if self.outer else {}}

    def _load_base_state(self, state: Dict) -> None:
        self.steps_in_round = int(state["steps_in_round"])
        self.outer_rounds = int(state["outer_rounds"])
        self.interval = int(state["interval"])
        if self.outer is not None:
            self.outer.load_state_dict(state["outer"])


@register
class DiLoCo(LocalSGDBase):
    name = "diloco"

    def end_round(self) -> None:
        deltas = self.outer.outer_gradient(self.ctx.optimizer.main_param_shards())
        mean, _ = run_blocking(fp32_mean(self.ctx.comm, torch.cat(deltas)))
        self.outer.step(split_like(mean, deltas))
        self.restart_from_anchor()

    def state_dict(self) -> Dict:
        return self._base_state()

    def load_state_dict(self, state: Dict) -> None:
        self._load_base_state(state)

    def stats(self) -> Dict[str, float]:
        return {"H": self.interval, "outer rounds": self.outer_rounds}
