"""`sync`: the baseline. Every step, after gradients are reduced inside the site, each
rank averages its own gradient shard across sites, so S sites behave exactly like one
data-parallel group of DP_intra x S replicas (fully synchronous Megatron).

With `--lsgd-compression` the average goes through the compressor (error feedback kept
across steps), which makes it gradient compression in the style of 1-bit Adam/PowerSGD.
"""

from __future__ import annotations

from typing import Dict, Optional

from megatron_lsgd.core.lsgd.compressors import CompressorBank
from megatron_lsgd.core.lsgd.protocol import SyncContext, Synchronizer
from megatron_lsgd.core.lsgd.reduction import run_blocking
from megatron_lsgd.core.lsgd.registry import register


def average_grads_across_sites(ctx: SyncContext, compressors: Optional[CompressorBank] = None) -> None:
    """Blocking mean of this rank's gradient shards over dp_inter (also used for the
    synchronous warm-up steps of the local-SGD algorithms, always uncompressed)."""
    comm = ctx.comm
    if comm.num_sites == 1:
        return
    views = ctx.optimizer.views()
    if compressors is None:
        handles = [comm.all_reduce_mean(grad, async_op=True) for grad in views.grad]
        for h in handles:
            h.wait()
    else:
        compressor = compressors.for_views(views, views.grad[0].device)
        for grad, mean in zip(views.grad, run_blocking(compressor.reduce(views.grad))):
            grad.copy_(mean)
    comm.rounds += 1


@register
class SyncEveryStep(Synchronizer):
    """Average gradients across sites every step (fully synchronous)"""

    name = "sync"
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
        if self.compressors is None:
            return {}
        comp = next(iter(self.compressors.compressors.values()), None)
        if comp is None or comp.last_input_norm == 0:
            return {}
        return {"comp rel err": comp.last_error_norm / comp.last_input_norm}
