"""`sync`: the baseline. Every step, after gradients are reduced inside the site, each
rank averages its own gradient shard across sites, so S sites behave exactly like one
data-parallel group of DP_intra x S replicas (fully synchronous Megatron)."""

from __future__ import annotations

from megatron_lsgd.core.lsgd.base import SyncContext, Synchronizer, register


def average_grads_across_sites(ctx: SyncContext) -> None:
    """Blocking mean of this rank's gradient shards over dp_inter (also used for the
    synchronous warm-up steps of the local-SGD algorithms)."""
    comm = ctx.comm
    if comm.num_sites == 1:
        return
    handles = [comm.all_reduce_mean(shard, async_op=True)
               for model in ctx.models for shard in model.local_grad_shards()]
    for h in handles:
        h.wait()
    comm.rounds += 1


@register
class SyncEveryStep(Synchronizer):
    name = "sync"

    def after_forward_backward(self, iteration: int) -> None:
        average_grads_across_sites(self.ctx)
