"""The synchronous warm-up of the local-SGD algorithms (`--lsgd-warmup-iters`)."""

from __future__ import annotations

from megatron_lsgd.core.lsgd.site_split import average_grads_across_sites


class SynchronousWarmup:
    """Mixin for local-SGD synchronizers: the first --lsgd-warmup-iters steps are plain
    synchronous training (gradients averaged across sites every step, uncompressed), and
    the local phase starts from the model the last of them made. Expects `self.ctx` and
    `self.active` (whether there is more than one site)."""

    @property
    def warmup_iters(self) -> int:
        return self.ctx.config.rounds.warmup_iters

    def in_warmup(self, iteration: int) -> bool:
        return iteration < self.warmup_iters

    def after_forward_backward(self, iteration: int) -> None:
        if self.active and self.in_warmup(iteration):
            # sites of different layouts: the synchronizer's layout-free exchange (None otherwise)
            average_grads_across_sites(self.ctx, exchange=getattr(self, "exchange", None))

    def warming_up(self, iteration: int, outer=None, views=None) -> bool:
        """From after_optimizer_step: True when `iteration` was a warm-up step (nothing local
        to do); after the last one the outer state's anchor (`outer`, over `views`) becomes
        the synchronously trained model, where the local phase starts."""
        if not self.in_warmup(iteration):
            return False
        if outer is not None and iteration == self.warmup_iters - 1:
            outer.reset(views)
        return True
