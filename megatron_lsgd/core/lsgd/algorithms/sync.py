"""`sync`: the baseline. Every step, after gradients are reduced inside the site, each
rank averages its own gradient shard across sites, so S sites behave exactly like one
data-parallel group of DP_intra x S replicas (fully synchronous Megatron).

With `--lsgd-compression` the average goes through the compressor (error feedback kept
across steps), which makes it gradient compression in the style of 1-bit Adam/PowerSGD.

Every step is a round of one step through the site membership (as torchft's own
data-parallel wrapper takes a quorum per step): its quorum before the forward pass, where
a returning site is healed, and the gradient mean as the round's one reduction. A mean
that does not commit is not applied (`update_due`): every site of the quorum skips the
step's inner update, as an fp16 overflow is skipped, and the error feedback is put back.
A plain run (`AllSites`) takes no quorum and commits every mean: the numbers are unchanged.
"""

from __future__ import annotations

from typing import Dict

from megatron_lsgd.core.lsgd.compressors import CompressorBank, compression_error
from megatron_lsgd.core.lsgd.protocol import SyncContext, Synchronizer
from megatron_lsgd.core.lsgd.registry import register
from megatron_lsgd.core.lsgd.site_split import SiteSplit, mean_grads_across_sites


@register
class SyncEveryStep(Synchronizer):
    """Average gradients across sites every step (fully synchronous)"""

    name = "sync"
    unequal_sites_refusal = None  # weighted by tokens, lane by lane (SiteSplit)
    elastic_unequal_sites_refusal = None  # a quorum per round on every lane (fault_tolerance/lanes.py)
    mixed_layouts_refusal = ("its every-step gradient mean and lane-by-lane gradient norm keep every site's replica "
                             "identical only when the sites share one layout")
    uses = frozenset({"compression"})
    fault_tolerance_refusal = None  # its rounds run through SiteMembership's quorums

    def __init__(self, ctx: SyncContext):
        super().__init__(ctx)
        cfg = ctx.config
        self.compressors = CompressorBank(cfg.compression, ctx.comm, cfg.seed) if cfg.compression.enabled else None
        self.split = SiteSplit(ctx.pgs, ctx.optimizer.sharded)
        self.committed = True  # whether this step's mean committed (its inner update is applied)

    def before_forward_backward(self, iteration: int) -> None:
        # Each step is a round: its membership is settled before it computes (a returning
        # site is healed here and computes the step from the live peers' state).
        if self.active:
            self.ctx.membership.round_started()

    def after_forward_backward(self, iteration: int) -> None:
        if not self.active:
            return
        views = self.ctx.optimizer.views()
        mine = self.split.mine(views)
        # the compressor's error feedback goes back as it was when a mean does not commit
        undo = [self.compressors.for_views(mine, mine.grad[0].device)] \
            if self.compressors is not None and mine.ranges else []
        # the mean lands in the gradients in place; reduce's result only says committed (True) or not (None)
        done = self.ctx.membership.reduce(
            lambda: mean_grads_across_sites(self.ctx.comm, self.split, mine, self.compressors) or True, undo)
        self.committed = done is not None
        # in the site, on every rank whatever the decision (all ranks of a site agree on it)
        self.split.gather(views.grad)
        self.ctx.comm.rounds += 1

    def update_due(self) -> bool:
        return self.committed

    def state_dict(self) -> Dict:
        return {"compressors": self.compressors.state_dict()} if self.compressors else {}

    def load_state_dict(self, state: Dict) -> None:
        if self.compressors is not None:
            views = self.ctx.optimizer.views()
            self.compressors.load_state_dict(state.get("compressors", {}), {views.key: views}, views.grad[0].device)

    def stats(self) -> Dict[str, float]:
        return compression_error(self.compressors.compressors.values()) if self.compressors is not None else {}
