"""`diloco`: H inner steps on each site, then a blocking mean of the outer gradient
Δ = θ_g - θ_local across sites and an outer Nesterov step on the anchor; every site
restarts from the new anchor (Douillard et al., DiLoCo; DESIGN.md §4.1).

Each rank handles only its own ZeRO-1 shard: the whole model is one fragment
(`optimizer.views()`), its mean runs on dp_inter through the fragment's compressor (fp32
by default, any `--lsgd-compression` with error feedback), and the site's all-gather in
copy_main_to_model_params() spreads the result inside the site. Sites of different TP x PP
exchange in the layout-free form instead (canonical_exchange.py). Sites of different sizes:
the mean is weighted by each site's tokens and runs lane by lane (`SiteSplit.mean`; int8/int4
by a compressor per lane, each site's contribution scaled: `SiteSplit.lane_compressors`). Without ZeRO-1 each rank
of a site takes 1/DP_intra of the model instead (`SiteSplit`), and `publish` gathers the
parts inside the site. With one site there is
nothing to average and the synchronizer does nothing, so S = 1 is plain Megatron.
"""

from __future__ import annotations

import abc
from typing import Dict, List

from megatron_lsgd.core.lsgd.canonical_exchange import exchange_for
from megatron_lsgd.core.lsgd.compressors import CompressorBank, compression_error
from megatron_lsgd.core.lsgd.outer_state import OuterState
from megatron_lsgd.core.lsgd.protocol import SyncContext, Synchronizer
from megatron_lsgd.core.lsgd.reduction import run_blocking
from megatron_lsgd.core.lsgd.registry import register
from megatron_lsgd.core.lsgd.site_split import SiteSplit
from megatron_lsgd.core.lsgd.warmup import SynchronousWarmup


class LocalSGDBase(SynchronousWarmup, Synchronizer, abc.ABC):
    """Shared by the DiLoCo family: warm-up, anchors, rounds of H inner steps."""

    uses = frozenset({"rounds", "outer", "compression"})
    inert_with_one_site = True

    def __init__(self, ctx: SyncContext, energy: float = 0.9):
        super().__init__(ctx)
        cfg = ctx.config
        self.interval = cfg.rounds.interval
        self.steps_in_round = 0
        self.outer_rounds = 0
        # (the shard sizes tell where the lanes lie: dilocox's mean cuts its shard at them)
        self.split = SiteSplit(ctx.pgs, ctx.optimizer.sharded, [m.numel() for m in ctx.optimizer.main_param_shards()])
        self.whole = ctx.optimizer.views()  # the whole model: one fragment
        self.views = self.split.mine(self.whole)  # the part of it this rank sends across sites
        self.outer = OuterState(ctx.optimizer.main_param_shards(), cfg.outer) if self.active else None
        self.compressors = CompressorBank(cfg.compression, ctx.comm, cfg.seed, energy)
        device = self.outer.device if self.outer else self.views.main[0].device
        self.compressor = self.compressors.for_views(self.views, device)
        # sites of different sizes: a compressor per lane, weighted (SiteSplit.lane_compressors);
        # the whole-shard one then only sizes payloads: its error feedback is the lanes'
        self.lane_compressors = self.split.lane_compressors(self.compressors, self.views, device, ctx.comm) \
            if self.active else []
        if self.lane_compressors:
            self.compressor.errors = []
        # sites of different TP x PP: what crosses sites goes in the layout-free form (None otherwise)
        self.exchange = exchange_for(ctx) if self.active else None

    def after_optimizer_step(self, iteration: int, update_successful: bool) -> None:
        if not self.active:
            return
        if self.warming_up(iteration, self.outer, self.views):
            return
        # Skipped (fp16 overflow) steps count too: sites must agree on round boundaries.
        self.steps_in_round += 1
        if self.steps_in_round >= self.interval:
            self._close_round()

    def before_forward_backward(self, iteration: int) -> None:
        # A round's membership is settled before its first inner step (a rejoining site is
        # healed here, so it trains the whole round from the live peers' state).
        if self.active and not self.in_warmup(iteration) and self.steps_in_round == 0:
            self.ctx.membership.round_started()

    def _close_round(self) -> None:
        self.steps_in_round = 0
        self.outer_rounds += 1  # counted before end_round: what it exchanges is of round outer_rounds - 1
        self.end_round()
        self.ctx.comm.rounds += 1

    def finish_training(self, iteration: int) -> None:
        # A run whose length is not a multiple of H ends with a shorter last round, so the
        # final model is the averaged anchor rather than each site's own drift.
        if self.active and self.steps_in_round > 0:  # only counted after warm-up
            self._close_round()

    def restart_from_anchor(self) -> None:
        self.outer.load_into(self.views)
        self.publish()

    def publish(self) -> None:
        """This rank's part of the main parameters changed: the site gathers the parts (when
        split) and the model takes the main parameters."""
        self.split.gather(self.whole.main)
        self.ctx.optimizer.copy_main_to_model_params()

    @abc.abstractmethod
    def end_round(self) -> None:
        """Called after the H-th inner step of a round: exchange and apply the outer step."""

    def per_parameter_state(self) -> Dict[str, List[object]]:
        # The anchor and outer momentum are this rank's on the part it sends across sites.
        return {"outer/anchors": [self.views], "outer/momentum": [self.views]} if self.outer else {}

    def _base_state(self) -> Dict:
        return {"steps_in_round": self.steps_in_round, "outer_rounds": self.outer_rounds,
                "interval": self.interval, "outer": self.outer.state_dict() if self.outer else {},
                "reducer": self.compressor.state_dict(),
                # sites of different sizes: each lane's error feedback
                **({"lane_reducers": [c.state_dict() for c in self.lane_compressors]} if self.lane_compressors else {})}

    def _load_base_state(self, state: Dict) -> None:
        self.steps_in_round = int(state["steps_in_round"])
        self.outer_rounds = int(state["outer_rounds"])
        self.interval = int(state["interval"])
        if self.outer is not None:
            self.outer.load_state_dict(state["outer"])
        if "reducer" in state:  # absent in diloco checkpoints written before diloco could compress
            self.compressor.load_state_dict(state["reducer"])
        for compressor, saved in zip(self.lane_compressors, state.get("lane_reducers", [])):
            compressor.load_state_dict(saved)


@register
class DiLoCo(LocalSGDBase):
    """H local steps, then a blocking mean of the pseudo-gradient and an outer Nesterov step"""

    name = "diloco"
    fault_tolerance_refusal = None  # its rounds run through SiteMembership's quorums
    unequal_sites_refusal = None  # weighted by tokens, lane by lane (SiteSplit)
    unequal_sites_compressions = ("int8", "int4")  # a compressor per lane, each site's contribution scaled
    elastic_unequal_sites_refusal = None  # a quorum per round on every lane (fault_tolerance/lanes.py)
    mixed_layouts_refusal = None  # the pseudo-gradient crosses sites in the layout-free form (CanonicalExchange)

    def end_round(self) -> None:
        deltas = self.outer.pseudo_gradient(self.views)
        if self.exchange is not None:
            mean = self.ctx.membership.reduce(lambda: self.exchange.mean(self.ctx.comm, self.views, deltas))
        elif self.lane_compressors and self.ctx.config.compression.enabled:  # sites of different sizes
            mean = self.ctx.membership.reduce(lambda: run_blocking(self.split.lane_reduce(
                self.ctx.comm, self.views, deltas, [c.reduce for c in self.lane_compressors])),
                undo=self.lane_compressors)
        else:
            mean = self.ctx.membership.reduce(
                lambda: self.split.mean(self.ctx.comm, deltas, lambda ds: run_blocking(self.compressor.reduce(ds))),
                undo=[self.compressor])
        if mean is not None:  # None: not committed (a site failed mid-round); the anchor stays
            self.outer.step(self.views, mean)
        self.restart_from_anchor()

    def state_dict(self) -> Dict:
        return self._base_state()

    def load_state_dict(self, state: Dict) -> None:
        self._load_base_state(state)

    def stats(self) -> Dict[str, float]:
        return {"H": self.interval, "outer rounds": self.outer_rounds,
                **compression_error([self.compressor, *self.lane_compressors])}
