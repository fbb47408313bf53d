"""A synchronizer context without a model or processes: a fake optimizer whose main
shards the test sets directly, and a one-site comm (collectives are local copies)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import List

import torch

from megatron_lsgd.core.lsgd.base import SyncContext
from megatron_lsgd.core.lsgd.comm import InterSiteComm
from megatron_lsgd.core.lsgd.config import LsgdConfig


class FakeOptimizer:
    def __init__(self, shards: List[torch.Tensor], layout):
        self.shards = shards
        self.layout = layout
        self.copies = 0

    def main_param_shards(self):
        return self.shards

    def shard_layout(self):
        return self.layout

    def copy_main_to_model_params(self):
        self.copies += 1


def make_context(config: LsgdConfig, shards: List[torch.Tensor], layout=None) -> SyncContext:
    layout = layout if layout is not None else [[((s.numel(),), 0, s.numel(), 0, s.numel())] for s in shards]
    pgs = SimpleNamespace(site=None)
    return SyncContext(pgs=pgs, config=config, models=[], optimizer=FakeOptimizer(shards, layout),
                       comm=InterSiteComm(None, 1))


def active(sync):
    """Force the local-SGD path on a one-site fake (the real loop disables it at S = 1)."""
    from megatron_lsgd.core.lsgd.outer_optimizer import OuterOptimizer

    cfg = sync.ctx.config
    sync.active = True
    sync.outer = OuterOptimizer(sync.ctx.optimizer.main_param_shards(), cfg.outer_lr, cfg.outer_momentum,
                                cfg.outer_offload)
    return sync
