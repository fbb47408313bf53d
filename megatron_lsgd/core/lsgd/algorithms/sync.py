"""`sync`: the baseline. Every step, after gradients are reduced inside the site, each
rank averages its own gradient shard across sites, so S sites behave exactly like one
data-parallel group of DP_intra x S replicas (fully synchronous Megatron).

With `--lsgd-compression` the average goes through the compressor (error feedback kept
across steps), which makes it gradient compression in the style of 1-bit Adam/PowerSGD.
"""

from __future__ import annotations

from typing import Dict

from megatron_lsgd.core.lsgd.compressors import CompressorBank, compression_error
from megatron_lsgd.core.lsgd.protocol import SyncContext, Synchronizer
from megatron_lsgd.core.lsgd.registry import register
from megatron_lsgd.core.lsgd.site_split import average_grads_across_sites


@register
class SyncEveryStep(Synchronizer):
    """Average gradients across sites every step (fully synchronous)"""

    name = "sync"
    unequal_sites_refusal = None  # weighted by tokens, lane by lane (SiteSplit)
    mixed_layouts_refusal = ("its every-step gradient mean and lane-by-lane gradient norm keep every site's replica "
                             "identical only when the sites share one layout")
    uses = frozenset({"compression"})

    def __init__(self, ctx: SyncContext):
        super().__init__(ctx)
        cfg = ctx.config
        self.compressors = CompressorBank(cfg.compression, ctx.comm, cfg.seed) if cfg.compression.enabled else None

    def after_forward_backward(self, iteration: int) -> None:
        average_grads_across_sites(self.ctx, self.compressors)

    def state_dict(self) -> Dict:
        return {"compressors": self.compressors.state_dict()} if self.compressors else {}

    def load_state_dict(self, state: Dict) -> None:
        if self.compressors is not None:
            views = self.ctx.optimizer.views()
            self.compressors.load_state_dict(state.get("compressors", {}), {views.key: views}, views.grad[0].device)

    def stats(self) -> Dict[str, float]:
        return compression_error(self.compressors.compressors.values()) if self.compressors is not None else {}
