"""The outer half of the dual optimizer policy, for any part of the model.

Each rank keeps, for its own ZeRO-1 main shard only, the fp32 anchor θ_g and the outer
momentum: one flat tensor per main shard, on the training device or, with
`--lsgd-outer-offload`, in (pinned) host memory where the outer arithmetic then runs.
Everything is addressed through `ShardViews` (a fragment: the whole model, one sync unit,
a set of layers), so the same four operations serve every algorithm:

    reset(views)             θ_g ← θ_local                       (start of local training)
    pseudo_gradient(views)   Δ = θ_g − θ_local                   (DiLoCo / torchft sign)
    step(views, Δ̄)           θ_g ← OuterSGD(θ_g, grad = Δ̄)       (Nesterov when momentum > 0)
    load_into(views)         θ_local ← θ_g                        (then copy_main_to_model_params)

The step is torch's own SGD (`torch.optim.sgd.sgd`, the function behind torch.optim.SGD)
applied to the views, so a fragment's step is exactly torch.optim.SGD's arithmetic on its
part of the anchor. A fragment's momentum starts (as torch's does) as a copy of its first
outer gradient; fragments stepped separately must therefore be disjoint. Each fragment
counts its own outer steps; the k-th takes (lr, momentum) = `OuterOptions.at(k)` (the
warm-up and decay schedules; constant by default).
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Set

import torch
import torch.distributed as dist
from torch.optim.sgd import sgd

from megatron_lsgd.core.lsgd.config import OuterOptions


class OuterState:
    def __init__(self, shards: List[torch.Tensor], options: OuterOptions):
        self.options = options
        self.lr, self.momentum = options.lr, options.momentum
        self.offload = options.offload
        self.device = torch.device("cpu") if options.offload else (shards[0].device if shards else torch.device("cpu"))
        pin = options.offload and torch.cuda.is_available()
        self.anchors = [self._alloc(s, pin) for s in shards]
        for a, s in zip(self.anchors, shards):
            a.copy_(s)
        self.momenta = [torch.zeros_like(a) for a in self.anchors] if self.momentum > 0 else []
        # Keyed by fragment (ShardViews.fragment), not by a rank's part of it, so the state
        # means the same at another DP_intra (tools/checkpoint/convert.py carries it).
        self._started: Set[str] = set()  # fragments whose momentum holds a first step
        self.steps: Dict[str, int] = {}  # outer steps taken per fragment, for the schedules

    def _alloc(self, shard: torch.Tensor, pin: bool) -> torch.Tensor:
        t = torch.empty(shard.shape, dtype=torch.float32, device=self.device)
        return t.pin_memory() if pin else t

    def anchor(self, views) -> List[torch.Tensor]:
        return views.select(self.anchors)

    @torch.no_grad()
    def reset(self, views) -> None:
        for a, m in zip(self.anchor(views), views.main):
            a.copy_(m)

    @torch.no_grad()
    def pseudo_gradient(self, views) -> List[torch.Tensor]:
        """Δ = θ_g − θ_local per range (on the anchor's device). Offloaded, the ranges are
        copied to the host without blocking and waited for once, before the host reads them
        (a non_blocking device-to-host copy may still be in flight otherwise)."""
        local = [m.to(self.device, non_blocking=True) for m in views.main]
        if any(m.is_cuda for m in views.main) and self.device.type == "cpu":
            torch.cuda.current_stream().synchronize()
        return [a - m for a, m in zip(self.anchor(views), local)]

    @torch.no_grad()
    def step(self, views, mean_grads: List[torch.Tensor]) -> None:
        params = self.anchor(views)
        grads = [g.to(self.device) for g in mean_grads]
        started = views.fragment in self._started
        self.steps[views.fragment] = k = self.steps.get(views.fragment, 0) + 1
        lr, momentum = self.options.at(k)
        buffers: List[Optional[torch.Tensor]] = views.select(self.momenta) if started else [None] * len(params)
        sgd(params, grads, buffers, weight_decay=0.0, momentum=momentum, lr=lr, dampening=0.0,
            nesterov=momentum > 0, maximize=False)
        if momentum > 0 and not started:  # torch created each buffer as a copy of the first grad
            for dst, buf in zip(views.select(self.momenta), buffers):
                dst.copy_(buf)
            self._started.add(views.fragment)

    @torch.no_grad()
    def load_into(self, views) -> None:
        """Restart this rank's local replica of the fragment from the anchor. From pinned host
        memory the copy is queued on the current stream, ahead of every kernel that reads the
        replica; the host writes the anchor again only after a blocking device-to-host copy
        (reset, pseudo_gradient), which waits for it."""
        for a, m in zip(self.anchor(views), views.main):
            m.copy_(a, non_blocking=True)

    def momentum_norm(self) -> float:
        return float(sum(float(m.pow(2).sum()) for m in self.momenta) ** 0.5)

    # weights_only-loadable: tensors, numbers, strings, lists, dicts.
    def state_dict(self) -> Dict:
        return {"anchors": [a.clone() for a in self.anchors], "momentum": [m.clone() for m in self.momenta],
                "momentum_started": sorted(self._started), "outer_steps": dict(self.steps)}

    @torch.no_grad()
    def load_state_dict(self, state: Dict) -> None:
        for a, saved in zip(self.anchors, state["anchors"]):
            a.copy_(saved)
        if "has_momentum" in state:  # written before fragments existed: one whole-model momentum
            started = ["all"] if state["has_momentum"] else []
        else:
            started = list(state["momentum_started"])
        self._started = {_fragment(key) for key in started}
        # absent in checkpoints that predate the schedules: they ran constant ones, so only a
        # run that adds a schedule on resume sees its count start again
        self.steps = {_fragment(str(key)): int(n) for key, n in state.get("outer_steps", {}).items()}
        if self.momentum > 0 and started:
            for m, saved in zip(self.momenta, state["momentum"]):
                m.copy_(saved)
        elif started and (not dist.is_initialized() or dist.get_rank() == 0):
            # not an error (a run may drop the momentum on purpose), but never silent: the
            # defaults were 0.7 / 0.9 until 2026-11-26, so an old run resumed without flags lands here
            print(" note: the checkpoint holds outer momentum, which this run does not use (--lsgd-outer-momentum 0, "
                  "the default since 2026-11-26; it was 0.9 with --lsgd-outer-lr 0.7): pass the saved run's "
                  "--lsgd-outer-lr and --lsgd-outer-momentum to continue it as it ran", flush=True)


_PART = re.compile(r"/part\d+of\d+$")


def _fragment(key: str) -> str:
    """Checkpoints written before the state was keyed by fragment name a rank's part of it
    ("all/part0of2" for a DP_intra rank without ZeRO-1): the fragment is the key without it."""
    return _PART.sub("", key)
