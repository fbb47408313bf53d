"""The dual optimizer policy's outer half.

Each rank keeps, for its own ZeRO-1 shard only (one flat tensor per bucket shard), the
fp32 anchor θ_g and the outer momentum, on the training device or on CPU
(`--lsgd-outer-offload`). The outer step is torch.optim.SGD (Nesterov when momentum > 0)
applied to the anchor with grad = Δ̄, where Δ = θ_g - θ_local (DiLoCo sign).
"""

from __future__ import annotations

from typing import Dict, List

import torch


class OuterOptimizer:
    def __init__(self, shards: List[torch.Tensor], lr: float, momentum: float, offload: bool = False):
        self.device = torch.device("cpu") if offload else (shards[0].device if shards else torch.device("cpu"))
        pin = offload and torch.cuda.is_available()
        self.anchors = [self._alloc(s, pin) for s in shards]
        self.reset_anchors(shards)
        self.lr, self.momentum = lr, momentum
        params = self.anchors or [torch.zeros(1)]
        self.opt = torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0)

    def _alloc(self, shard: torch.Tensor, pin: bool) -> torch.Tensor:
        t = torch.empty(shard.shape, dtype=torch.float32, device=self.device)
        return t.pin_memory() if pin else t

    @torch.no_grad()
    def reset_anchors(self, shards: List[torch.Tensor]) -> None:
        for a, s in zip(self.anchors, shards):
            a.copy_(s)

    @torch.no_grad()
    def outer_gradient(self, shards: List[torch.Tensor]) -> List[torch.Tensor]:
        """Δ = θ_g - θ_local per shard (on the anchor's device)."""
        return [a - s.to(self.device, non_blocking=True) for a, s in zip(self.anchors, shards)]

    @torch.no_grad()
    def step(self, mean_grads: List[torch.Tensor]) -> None:
        for a, g in zip(self.anchors, mean_grads):
            a.grad = g.to(self.device)
        self.opt.step()
        for a in self.anchors:
            a.grad = None

    @torch.no_grad()
    def load_into(self, shards: List[torch.Tensor]) -> None:
        """Restart the local replica's shard from the anchor."""
        for a, s in zip(self.anchors, shards):
            s.copy_(a, non_blocking=True)

    # weights_only-loadable: tensors, numbers, lists, dicts.
    def state_dict(self) -> Dict:
        bufs = [self.opt.state.get(a, {}).get("momentum_buffer") for a in self.anchors]
        return {"anchors": [a.clone() for a in self.anchors],
                "momentum": [b.clone() if b is not None else torch.empty(0) for b in bufs],
                "has_momentum": int(all(b is not None for b in bufs) and bool(bufs))}

    @torch.no_grad()
    def load_state_dict(self, state: Dict) -> None:
        for a, saved in zip(self.anchors, state["anchors"]):
            a.copy_(saved)
        self.opt.state.clear()
        if state.get("has_momentum"):
            for a, b in zip(self.anchors, state["momentum"]):
                self.opt.state[a]["momentum_buffer"] = b.to(self.device).clone()

    def momentum_norm(self) -> float:
        bufs = [self.opt.state.get(a, {}).get("momentum_buffer") for a in self.anchors]
        return float(sum(float(b.pow(2).sum()) for b in bufs if b is not None) ** 0.5)
