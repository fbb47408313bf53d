"""`edit`: layer-wise synchronization in the forward pass (EDiT, Algorithms 1-2 of the paper;
DESIGN.md §4.4).

After `--lsgd-warmup-iters` fully synchronous steps (gradients averaged across sites), each
site trains on its own. Every H inner steps a sync is due; it is carried out in the forward
pass of the next step, sync unit by sync unit (embedding, each layer, head of this pipeline
stage), in the unit's forward-pre hook on the first micro-batch, just before the unit
computes:

  at the step boundary (after the H-th step), once for all units of the stage:
    G = ||Δ|| per unit and site, Δ = θ_g − θ_local (anchor minus local, DiLoCo's sign)
    over the unit's whole parameters: this rank's ZeRO slices, summed over the tensor-
    parallel ranks (replicated parameters counted once) and the ZeRO shards of dp_intra,
    then all-gathered across sites (one small message). The penalty (penalty.py) flags,
    weighs and decides roll-backs from G, identically on every rank.
  in the unit's forward-pre hook:
    launch the unit's exchange (and, with --lsgd-edit-prefetch N, the next N units', so
    their transfers overlap this unit's compute); wait for the unit's; then
      Δ̄ = Σ_i w_i Δ_i           (each site sends S w_i Δ_i through the unit's compressor,
                                  which means over dp_inter: only this rank's ZeRO slices)
      Δ̄ *= min(φ / (||Δ̄|| + ε), 1)      (clip, the norm again over the whole unit)
      θ_g ← OuterNesterov(θ_g, Δ̄);  θ_local ← θ_g    (OuterState, per unit fragment)
    or, when every site is flagged, θ_local ← θ_g (roll back, no outer step);
    then copy_main_to_model_params(unit) spreads the unit's slices inside the site
    (one all-gather of the unit's extents over dp_intra) and the unit computes.

A sync that is due when training ends (--train-iters) or a last, partial round is carried
out by finish_training, so every site ends with the same model. A sync that is due when the
loop evaluates or saves a checkpoint is carried out by quiesce(), before it: evaluation and
checkpoints see the synced model, as diloco's do at the end of a round. Nothing changes the
local model between the step boundary and the next forward, so carrying the sync out there
gives the same numbers as carrying it out in the forward. Anchors only take averaged steps
and are bit-identical on every site.

Tied embeddings with pipeline parallelism: the last stage holds a copy of the word
embedding inside its `output` unit. The copy takes the first stage's `embedding` decision:
its norm comes from the first stage over the embedding group at the step boundary, and
its clip coefficient when the first stage's embedding has synced (an asynchronous
all-reduce the first stage waits for after its backward). Uncompressed, both copies then
take bit-identical steps; lossy compression cannot (the two stages' quantization blocks
differ), so that combination is refused.

Communication: each rank talks only to its dp_inter peers (same TP/PP/ZeRO coordinate on
the other sites), on a dp_inter group of its own (comm.use_dedicated_group), in the same
order on every site: the norm gather at the boundary, then per unit its reduction phases.
Under ZeRO-1 a rank exchanges its slices of the unit; without ZeRO-1 (every rank of a site
holds whole units) with DP_intra > 1, each rank exchanges its 1/DP_intra part of the unit
(ShardViews.part, as `sync` does) and the site all-gathers the parts before the unit
computes, so a site's traffic is split over its DP_intra links either way.
Outer state may live on the host (--lsgd-outer-offload): the per-unit arithmetic then runs
there (no device prefetch of offloaded state yet).

Each sync is a round of the site membership (membership.py; round.py): taken at the step
boundary (`begin_sync`), issued where the membership's rhythm says (`Exchanges`): a fixed set
of sites at once, elastic sites (--lsgd-fault-tolerance torchft, docs/fault_tolerance.md)
after the next step's quorum, where a returning site is healed (it then sends, for that
sync, the Δ of the peer it was healed from), so the norm gather and every unit's exchange
run on the quorum's group: the same numbers. Each of those collectives runs `within` the
round (a failure is reported, not raised; the rest are not sent), and a failed norm gather
makes every rank of the site roll every unit back, so its ranks' collectives stay alike. A
site absent from the round is left out of the penalty as a flagged one is (no weight, no
statistics). The sync is decided after the forward pass that carried it out (or by
quiesce / the end of training). Not committed: the anchors, outer momenta, penalty
statistics and error feedback go back to what they were when it was issued, and every
unit restarts from its anchor (RoundUndo). The closing sync (a due one, a partial round)
is a round of its own (`close_exchanges`); not committed, it ends training at the anchors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_lsgd.core.lsgd.agreement import failed_anywhere_in_site
from megatron_lsgd.core.lsgd.compressors import CompressorBank
from megatron_lsgd.core.lsgd.algorithms.edit.penalty import PARTS, Decision, Penalty, clip_coefficient, parse_parts
from megatron_lsgd.core.lsgd.algorithms.edit.round import RoundUndo, SyncWork
from megatron_lsgd.core.options import OptionGroup, option
from megatron_lsgd.core.lsgd.outer_state import OuterState
from megatron_lsgd.core.lsgd.protocol import MicroBatch, SyncContext, Synchronizer
from megatron_lsgd.core.lsgd.reduction import PendingReduce
from megatron_lsgd.core.lsgd.registry import register
from megatron_lsgd.core.lsgd.site_split import SiteSplit
from megatron_lsgd.core.lsgd.warmup import SynchronousWarmup
from megatron_lsgd.core.optimizer.shard_views import sum_of_squares

Fault = Tuple[Optional[int], int, float]  # (site or None for every site, sync number, factor)


def parse_faults(text: str, num_sites: int) -> List[Fault]:
    """'1:5:100,all:7:1e6' -> [(1, 5, 100.0), (None, 7, 1e6)] (--lsgd-edit-inject-fault)."""
    out: List[Fault] = []
    for item in [x.strip() for x in (text or "").split(",") if x.strip()]:
        parts = item.split(":")
        try:
            if len(parts) != 3:
                raise ValueError
            site = None if parts[0] == "all" else int(parts[0])
            sync, factor = int(parts[1]), float(parts[2])
        except ValueError:
            raise ValueError(f"--lsgd-edit-inject-fault {item!r}: expected SITE:SYNC:FACTOR (SITE a site index or "
                             f"all), e.g. 1:5:100") from None
        if site is not None and not 0 <= site < num_sites:
            raise ValueError(f"--lsgd-edit-inject-fault {item!r}: site {site} is not in 0..{num_sites - 1}")
        if sync < 1:
            raise ValueError(f"--lsgd-edit-inject-fault {item!r}: syncs are numbered from 1")
        if not factor > 0:
            raise ValueError(f"--lsgd-edit-inject-fault {item!r}: the factor must be > 0")
        out.append((site, sync, factor))
    return out


@dataclass
class EDiTOptions(OptionGroup):
    prefetch: int = option("--lsgd-edit-prefetch", 1,
                           "units whose exchange is launched ahead of the unit about to compute, so their transfers "
                           "overlap its forward (0: each unit exchanges just before it computes)", metavar="N")
    penalty: str = option("--lsgd-edit-penalty", "anomaly,weighted,clip",
                          "pseudo-gradient penalty parts, comma-separated: anomaly (EMA z-test, flagged sites "
                          "excluded), weighted (softmax of the negative norms), clip (phi); none: plain average",
                          metavar="PARTS")
    z_threshold: float = option("--lsgd-edit-z-threshold", 3.0, "anomaly: flag a site whose norm's EMA z-score "
                                "exceeds this (delta)", metavar="DELTA")
    ema_alpha: float = option("--lsgd-edit-ema-alpha", 0.02, "anomaly: EMA weight of a new norm (alpha)",
                              metavar="ALPHA")
    ema_warmup: int = option("--lsgd-edit-ema-warmup", 10, "anomaly: observations per unit and site before a site "
                             "can be flagged (mean and variance are exact over them)", metavar="N")
    norms: str = option("--lsgd-edit-norms", "auto",
                        "which norms the anomaly test and the weights see: raw (the paper's ||Δ||), per-step "
                        "(||Δ|| / the site's local steps since the last sync), auto (per-step when sites take "
                        "different numbers of steps, as with a-edit; raw otherwise)",
                        choices=("auto", "raw", "per-step"))
    clip: float = option("--lsgd-edit-clip", 28.0, "clip: the averaged pseudo-gradient's norm per unit is clipped "
                         "to this (phi; the paper's 10 is of one of a module's 8 shards, about 28 on this whole-unit "
                         "norm)", metavar="PHI")
    inject_fault: str = option("--lsgd-edit-inject-fault", "",
                               "fault injection (tests, demonstrations): SITE:SYNC:FACTOR[,...] multiplies site "
                               "SITE's pseudo-gradient (all: every site's) by FACTOR at sync number SYNC (from 1)",
                               metavar="SPEC")

    def validate(self, config, num_sites: int, run=None, **_) -> None:
        if self.prefetch < 0:
            raise ValueError(f"--lsgd-edit-prefetch must be >= 0 (got {self.prefetch})")
        parts = parse_parts(self.penalty)
        if self.z_threshold <= 0:
            raise ValueError(f"--lsgd-edit-z-threshold must be > 0 (got {self.z_threshold})")
        if not 0 < self.ema_alpha <= 1:
            raise ValueError(f"--lsgd-edit-ema-alpha must be in (0, 1] (got {self.ema_alpha})")
        if self.ema_warmup < 1:
            raise ValueError(f"--lsgd-edit-ema-warmup must be >= 1 (got {self.ema_warmup})")
        if not self.clip > 0:
            raise ValueError(f"--lsgd-edit-clip must be > 0 (got {self.clip})")
        defaults = type(self)()
        if self.norms not in ("auto", "raw", "per-step"):
            raise ValueError(f"--lsgd-edit-norms {self.norms!r}: choose auto, raw or per-step")
        if self.norms != "auto" and not parts & {"anomaly", "weighted"}:
            raise ValueError(f"--lsgd-edit-norms needs 'anomaly' or 'weighted' in --lsgd-edit-penalty "
                             f"(got {self.penalty!r})")
        for part, attrs in (("anomaly", ("z_threshold", "ema_alpha", "ema_warmup")), ("clip", ("clip",))):
            for attr in attrs:
                if part not in parts and getattr(self, attr) != getattr(defaults, attr):
                    flag = next(f.metadata["flag"] for f in self.option_fields() if f.name == attr)
                    raise ValueError(f"{flag} needs '{part}' in --lsgd-edit-penalty (got {self.penalty!r})")
        parse_faults(self.inject_fault, num_sites)
        if run is not None and config.compression.enabled and run.pipeline_stages > 1 and run.tied_embeddings:
            raise ValueError(f"--lsgd-compression {config.compression.kind} with tied embeddings and "
                             f"--pipeline-model-parallel-size > 1: the two stages' copies of the word embedding "
                             f"would be quantized differently and drift apart; pass "
                             f"--untie-embeddings-and-output-weights or --lsgd-compression none")


class _Params:
    """A named set of parameters, taken by ShardedOptimizer.views() like a SyncUnit."""

    def __init__(self, name: str, params: Sequence[torch.nn.Parameter]):
        self.name = name
        self._params = list(params)

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return iter(self._params)


@dataclass
class _Group:
    """Parameters that share one penalty decision: a unit, or on the last stage of a tied
    pipeline the unit without its copy of the word embedding, and the copy itself."""

    stat: str  # decision / statistics key: the unit's name ("embedding" for the tied copy)
    views: object  # ShardViews this rank exchanges: its ZeRO slices (or, without ZeRO-1, its 1/DP_intra part)
    whole: object  # ShardViews of everything this rank holds of the group (== views under ZeRO-1)
    counted: List[Tuple[int, int, int]]  # (range, lo, hi) of the pieces of `views` that count in norms
    borrowed: bool  # the last stage's tied copy: norm and clip come from the first stage
    compressor: object = None


@dataclass
class _UnitPlan:
    unit: object
    views: object  # the whole unit (for copy_main_to_model_params)
    groups: List[_Group]


@register
class EDiT(SynchronousWarmup, Synchronizer):
    """Layer-wise parameter sync in the forward pass every H steps, with prefetch and the pseudo-gradient penalty"""

    name = "edit"
    fault_tolerance_refusal = None  # a sync is a round of the membership (round.py), its collectives `within` it
    unequal_sites_refusal = ("its per-unit syncs in the forward pass and the penalty's per-site norms assume one "
                             "dp_inter group with the same shard on every site")
    Options = EDiTOptions
    uses = frozenset({"rounds", "outer", "compression"})
    uses_unit_forward_hooks = True
    inert_with_one_site = True  # one site: plain training (a warning at start)

    def __init__(self, ctx: SyncContext):
        super().__init__(ctx)
        cfg, opts = ctx.config, ctx.config.algo
        self.num_sites = ctx.comm.num_sites
        self.site = getattr(ctx.pgs, "site_rank", 0)
        self.interval = cfg.rounds.interval
        self.prefetch = opts.prefetch
        self.penalty = Penalty(parse_parts(opts.penalty), self.num_sites, opts.z_threshold, opts.ema_alpha,
                               opts.ema_warmup, opts.clip)
        self.faults = parse_faults(opts.inject_fault, self.num_sites)
        self.per_step_norms = opts.norms == "per-step" or (opts.norms == "auto" and not self.lockstep)
        self.steps_in_round = 0
        self.syncs = 0
        self.pending = False  # a sync is issued: carried out in the next forward (or finish_training)
        # Exchanges (membership.py): a sync taken at a step boundary and not issued yet (its sites'
        # steps; elastic sites issue it after the next step's quorum), the membership's ticket of
        # the sync issued until it is decided, and whether the closing exchanges are under way.
        self.due: Optional[List[int]] = None
        self.round = None
        self.finishing = False
        self.decisions: Dict[str, Decision] = {}
        self.flagged_counts = [0] * self.num_sites  # (unit, site) exclusions so far, per site
        self.rollbacks = 0  # units rolled back to their anchor so far
        self.last_min_weight = 1.0 / max(self.num_sites, 1)
        self.last_max_norm = 0.0  # the largest finite per-site unit norm of the last sync (to choose phi)
        self.clipped = 0  # unit syncs whose mean was clipped so far
        self._issued: Dict[int, List[Optional[PendingReduce]]] = {}
        self._tied_work = None
        self._tied_buf: Optional[torch.Tensor] = None
        self.plans: List[_UnitPlan] = []
        self.outer: Optional[OuterState] = None
        if not self.active:
            return  # one site: nothing to synchronize, plain training
        ctx.comm.use_dedicated_group(ctx.pgs.dims)
        opt = ctx.optimizer
        self.outer = OuterState(opt.main_param_shards(), cfg.outer)
        self.device = opt.main_param_shards()[0].device
        self.bank = CompressorBank(cfg.compression, ctx.comm, cfg.seed)
        # Without ZeRO-1 every rank of a site holds the same, whole units: each then exchanges
        # only its 1/DP_intra part (as `sync` does) and the site all-gathers the parts.
        self.split = SiteSplit(ctx.pgs, opt.sharded)
        self.plans = self._plan(ctx.units)
        self.index = {p.unit.name: i for i, p in enumerate(self.plans)}
        self.stat_keys: List[str] = []
        for plan in self.plans:
            for g in plan.groups:
                if g.stat not in self.stat_keys:
                    self.stat_keys.append(g.stat)
        pgs = ctx.pgs
        tied_pp = pgs.dims.pp > 1 and "embedding" in self.stat_keys
        self.lends_embedding = tied_pp and pgs.is_first_stage and any(
            ctx.is_tied_embedding(p) for p in self.plans[0].unit.parameters())
        self.borrows_embedding = tied_pp and any(g.borrowed for p in self.plans for g in p.groups)

    # ---- plan: units -> penalty groups ----------------------------------------------------
    def _plan(self, units) -> List[_UnitPlan]:
        opt, pgs = self.ctx.optimizer, self.ctx.pgs

        def tied_copy(p) -> bool:
            return self.ctx.is_tied_embedding(p) and not pgs.is_first_stage

        def group(stat, part, borrowed) -> _Group:
            whole = opt.views([part])
            views = self.split.mine(whole)
            counted = opt.counted_spans(views)
            comp = None if views.empty else self.bank.for_views(views, self.outer.device)
            return _Group(stat, views, whole, counted, borrowed, comp)

        plans = []
        for unit in units:
            params = list(unit.parameters())
            copy = [p for p in params if tied_copy(p)]
            if copy:
                own = [p for p in params if not tied_copy(p)]
                groups = ([group(unit.name, _Params(f"{unit.name}.own", own), False)] if own else []) + \
                    [group("embedding", _Params(f"{unit.name}.tied-embedding", copy), True)]
            else:
                groups = [group(unit.name, unit, False)]
            plans.append(_UnitPlan(unit, opt.views([unit]), groups))
        return plans

    # ---- intra-site helpers ---------------------------------------------------------------------
    def _site_sum(self, t: torch.Tensor) -> None:
        """Sum over the ranks of this stage that hold pieces of the same units: TP ranks and
        the site's dp_intra ranks when each holds (or exchanges) only a part of every unit
        (ZeRO-1 shards, or the split without ZeRO-1)."""
        pgs = self.ctx.pgs
        if pgs.dims.tp > 1:
            dist.all_reduce(t, group=pgs.tp)
        if self.ctx.optimizer.sharded or self.split.active:
            dist.all_reduce(t, group=pgs.dp_intra)

    def _wait_tied(self) -> None:
        if self._tied_work is not None:
            self._tied_work.wait()
            self._tied_work, self._tied_buf = None, None

    def _fault_factor(self, sync: int) -> float:
        factor = 1.0
        for site, number, f in self.faults:
            if number == sync and (site is None or site == self.site):
                factor *= f
        return factor

    # ---- the sync ----------------------------------------------------------------------------
    def _gather_norms(self, factor: float) -> Optional[List[List[float]]]:
        """Per site and statistic key, ||Δ|| over the whole unit (see the module docstring); a
        site absent from the round has inf (excluded, as a flagged site is). None when the
        gather failed on any rank of the site (the round will not commit)."""
        k = len(self.stat_keys)
        local = torch.zeros(k, dtype=torch.float64, device=self.device)
        for plan in self.plans:
            for g in plan.groups:
                if not g.borrowed and g.counted:
                    local[self.stat_keys.index(g.stat)] += sum_of_squares(self.outer.pseudo_gradient(g.views), g.counted)
        local *= factor * factor
        self._site_sum(local)
        if self.lends_embedding or self.borrows_embedding:  # the tied copy's norm is the first stage's
            j = self.stat_keys.index("embedding")
            t = local[j:j + 1].clone() if self.lends_embedding else torch.zeros(1, dtype=torch.float64,
                                                                                device=self.device)
            dist.all_reduce(t, group=self.ctx.pgs.embedding)
            local[j] = t[0]
        order = list(self.ctx.membership.round_sites())
        out = torch.zeros(len(order) * k, dtype=torch.float64, device=self.device)

        def gather() -> bool:
            self.ctx.comm.all_gather(out, local)
            return True

        # every rank of the site decides alike (its collectives depend on the decisions), even
        # when only some of the site's links failed
        if failed_anywhere_in_site(self.ctx.membership.within(self.round, gather, False), self.ctx.pgs, self.device):
            return None
        norms = [[math.inf] * k for _ in range(self.num_sites)]
        for site, row in zip(order, out.view(len(order), k).sqrt().tolist()):
            norms[site] = row
        return norms

    def begin_sync(self, site_steps: Sequence[int]) -> None:
        """At a step boundary: a sync is due. `site_steps`: every site's local steps since the
        last sync (for per-step norms). The membership issues it (`taken`): a fixed set of
        sites at once, elastic sites after the next step's quorum (`step_started`)."""
        self.due = list(site_steps)
        self.ctx.membership.taken(self)

    def _open_round(self, site_steps: Sequence[int]) -> None:
        """Issue a sync, a round of the membership: decide every unit's sync (collective over
        the stage, the site and dp_inter); the data moves in the next forward (or
        sync_units), each unit's exchange through `membership.within`."""
        self._start_round()
        self._decide_units(site_steps)

    def _start_round(self) -> None:
        """Open the round whose reduction is the sync (RoundUndo: what a lost one puts back)."""
        self.round = self.ctx.membership.start(lambda: SyncWork(self), undo=[RoundUndo(self)])

    def _decide_units(self, site_steps: Sequence[int]) -> None:
        """The sync of the open round: the norm gather and every unit's decision (see _open_round)."""
        self.syncs += 1
        self.ctx.comm.rounds += 1
        present = set(self.ctx.membership.round_sites())
        norms = self._gather_norms(self._fault_factor(self.syncs)) if self.penalty.needs_norms else None
        if not self.penalty.needs_norms:
            self.decisions = {key: self.penalty.decide(key, []) for key in self.stat_keys}
        elif norms is None:  # the gather failed: the round rolls back; every rank of the site skips alike
            self.decisions = {key: Decision([0.0] * self.num_sites, [True] * self.num_sites)
                              for key in self.stat_keys}
        else:
            finite = [g for row in norms for g in row if math.isfinite(g)]
            self.last_max_norm = max(finite) if finite else math.inf
            if self.per_step_norms:  # a site that took more steps is not penalized for it
                norms = [[g / max(n, 1) for g in row] for row, n in zip(norms, site_steps)]
            for j, key in enumerate(self.stat_keys):
                self.decisions[key] = self.penalty.decide(key, [row[j] for row in norms])
        weights = []
        for d in self.decisions.values():
            self.rollbacks += int(d.rollback)
            for i, f in enumerate(d.flagged):
                self.flagged_counts[i] += int(f and i in present)  # (an absent site is not flagged)
            weights += [w for w, f in zip(d.weights, d.flagged) if not f]
        self.last_min_weight = min(weights) if weights else 0.0
        self.pending = True

    def _issue(self, j: int) -> None:
        if j in self._issued:
            return
        handles: List[Optional[PendingReduce]] = []
        factor = self._fault_factor(self.syncs)
        me, s = self.site, self.ctx.comm.num_sites  # (the sites of the round)
        for g in self.plans[j].groups:
            d = self.decisions[g.stat]
            if d.rollback or g.views.empty:  # every dp_inter peer skips the same reductions
                handles.append(None)
                continue
            deltas = self.outer.pseudo_gradient(g.views)
            if d.flagged[me]:
                for x in deltas:
                    x.zero_()
            else:
                scale = factor * (d.weights[me] * s if ("weighted" in self.penalty.parts or any(d.flagged)) else 1.0)
                if scale != 1.0:
                    for x in deltas:
                        x.mul_(scale)
            # None: the round failed (its units then take no outer step, and it rolls back)
            handles.append(self.ctx.membership.within(self.round, lambda: PendingReduce(g.compressor.reduce(deltas))))
        self._issued[j] = handles

    def _clip(self, g: _Group, mean: List[torch.Tensor]) -> float:
        pgs = self.ctx.pgs
        if g.borrowed:  # the first stage's coefficient for the word embedding
            t = torch.zeros(1, dtype=torch.float64, device=self.device)
            dist.all_reduce(t, group=pgs.embedding)
            return float(t[0])
        sq = torch.tensor([sum_of_squares(mean, g.counted) if mean else 0.0], dtype=torch.float64, device=self.device)
        self._site_sum(sq)
        beta = clip_coefficient(math.sqrt(float(sq[0])), self.penalty.phi)
        if g.stat == "embedding" and self.lends_embedding:
            # The last stage joins when its output unit syncs, later in this forward: do not wait here.
            self._wait_tied()
            self._tied_buf = torch.tensor([beta], dtype=torch.float64, device=self.device)
            self._tied_work = dist.all_reduce(self._tied_buf, group=pgs.embedding, async_op=True)
        return beta

    def _apply(self, j: int) -> None:
        plan = self.plans[j]
        for g, handle in zip(plan.groups, self._issued.pop(j)):
            d = self.decisions[g.stat]
            if d.rollback:
                self.outer.load_into(g.views)
                continue
            mean = self.ctx.membership.within(self.round, handle.wait, []) if handle is not None else []
            if self.penalty.clips:
                beta = self._clip(g, mean)
                if beta < 1.0:
                    self.clipped += 1
                    for m in mean:
                        m.mul_(beta)
            if mean:
                self.outer.step(g.views, mean)
                self.outer.load_into(g.views)
        # each rank synced its part of the unit (when split): the site gathers the parts
        self.split.gather([m for g in plan.groups for m in g.whole.main])
        self.ctx.optimizer.copy_main_to_model_params(plan.views)

    def _consume(self, j: int) -> None:
        for k in range(j, min(j + self.prefetch, len(self.plans) - 1) + 1):
            self._issue(k)
        self._apply(j)
        if j == len(self.plans) - 1:
            self.pending = False

    def sync_units(self) -> None:
        """Carry out an issued sync outside the forward pass (quiesce, finish_training)."""
        for j in range(len(self.plans)):
            self._consume(j)
        self._wait_tied()

    def _decide(self) -> None:
        """The issued sync is over (its units synced, here if the forward did not): the
        membership decides it. Not committed: RoundUndo put everything back."""
        if self.round is None:
            return
        if self.pending:
            self.sync_units()
        self._wait_tied()
        ticket, self.round = self.round, None
        self.ctx.membership.finish(ticket)

    def restart_from_anchors(self) -> None:
        """Every unit's local parameters become its anchor (a round that was not committed)."""
        self.pending, self._issued = False, {}
        for plan in self.plans:
            for g in plan.groups:
                self.outer.load_into(g.views)
            self.split.gather([m for g in plan.groups for m in g.whole.main])
            self.ctx.optimizer.copy_main_to_model_params(plan.views)

    def compressed_views(self) -> Dict[str, object]:
        return {g.views.key: g.views for p in self.plans for g in p.groups if not g.views.empty}

    # ---- Exchanges: what the membership's rhythm drives (membership.py) ---------------------------
    def exchange_due(self) -> bool:
        return self.due is not None

    def issue_due(self) -> None:
        steps, self.due = self.due, None
        self._open_round(steps)

    def decide_open(self) -> None:
        self._decide()

    def land_in_flight(self) -> None:
        self._decide()

    def closing_due(self) -> bool:
        return self.due is not None

    def close_one(self) -> None:
        """The last sync, a round of its own. Not committed: every unit is back at its anchor
        (the same on every site), which ends training as diloco's lost last round does."""
        self.issue_due()
        self._decide()

    def closed(self) -> None:
        pass

    # ---- hooks -----------------------------------------------------------------------------------
    def before_forward_backward(self, iteration: int) -> None:
        if self.active:  # elastic sites: the quorum of a sync due (a returning site is healed), then its issue
            self.ctx.membership.step_started(self)

    def before_unit_forward(self, unit, microbatch: MicroBatch) -> None:
        if self.pending and microbatch.first:
            self._consume(self.index[unit.name])

    def after_forward_backward(self, iteration: int) -> None:
        if not self.active:
            return
        self._wait_tied()
        if not self.pending:  # the forward synced every unit of the stage: the sync is decided
            self._decide()
        super().after_forward_backward(iteration)

    def after_optimizer_step(self, iteration: int, update_successful: bool) -> None:
        if not self.active or self.warming_up(iteration, self.outer, self.ctx.optimizer.views()):
            return
        self.steps_in_round += 1  # skipped (fp16 overflow) steps count too: sites must agree
        if self.steps_in_round >= self.interval:
            self.steps_in_round = 0
            self.begin_sync([self.interval] * self.num_sites)

    def quiesce(self) -> None:
        # evaluate and save the synced model, not this site's local one (a sync elastic sites
        # have not issued yet, due at the next step's quorum, stays due: the state holds it)
        self._decide()
        self._wait_tied()

    def finish_training(self, iteration: int) -> None:
        if not self.active:
            return
        if self.steps_in_round > 0:  # a last, partial round
            self.due = [self.steps_in_round] * self.num_sites
            self.steps_in_round = 0
        self.ctx.membership.close_exchanges(self)  # what is issued lands, then the sync due

    # ---- state and stats -------------------------------------------------------------------------
    def per_parameter_state(self) -> Dict[str, List[object]]:
        # The anchor and outer momentum are this rank's on the unit parts it sends across sites.
        if not self.active:
            return {}
        owned = [g.views for p in self.plans for g in p.groups]
        return {"outer/anchors": owned, "outer/momentum": owned}

    def state_dict(self) -> Dict:
        if not self.active:
            return {}
        # No quiesce() here (state_dict has no side effects): the checkpoint calls it first.
        self.require_quiesced(self.round is not None)
        state = {"steps_in_round": self.steps_in_round, "syncs": self.syncs, "pending": int(self.pending),
                "interval": self.interval, "decisions": {k: d.state() for k, d in sorted(self.decisions.items())},
                "penalty": self.penalty.state_dict(), "outer": self.outer.state_dict(),
                "compressors": self.bank.state_dict(), "flagged_counts": list(self.flagged_counts),
                "rollbacks": self.rollbacks, "last_min_weight": self.last_min_weight,
                "last_max_norm": self.last_max_norm, "clipped": self.clipped}
        if self.due is not None:  # elastic sites only: a sync taken, issued after the next quorum
            state["due"] = list(self.due)
        if self.finishing:
            state["finishing"] = 1
        return state

    def load_state_dict(self, state: Dict) -> None:
        if not self.active:
            return
        self.steps_in_round = int(state["steps_in_round"])
        self.syncs = int(state["syncs"])
        self.pending = bool(state["pending"])
        self.decisions = {k: Decision.from_state(d) for k, d in state["decisions"].items()}
        self.penalty.load_state_dict(state["penalty"])
        self.outer.load_state_dict(state["outer"])
        self.bank.load_state_dict(state["compressors"], self.compressed_views(), self.outer.device)
        self.due = [int(n) for n in state["due"]] if "due" in state else None
        self.finishing = bool(state.get("finishing", 0))
        self.round, self._issued = None, {}
        self.flagged_counts = [int(c) for c in state["flagged_counts"]]
        self.rollbacks = int(state["rollbacks"])
        self.last_min_weight = float(state["last_min_weight"])
        self.last_max_norm = float(state.get("last_max_norm", 0.0))
        self.clipped = int(state.get("clipped", 0))

    def stats(self) -> Dict[str, float]:
        if not self.active:
            return {}
        stats = {"H": self.interval, "syncs": self.syncs}
        if self.penalty.parts:
            stats.update({"flagged": sum(self.flagged_counts), "rollbacks": self.rollbacks,
                          "min weight": self.last_min_weight})
            if self.penalty.needs_norms:
                stats["max norm"] = self.last_max_norm
            if self.penalty.clips:
                stats["clipped"] = self.clipped
            stats.update({f"flagged site{i}": c for i, c in enumerate(self.flagged_counts) if c})
        return stats


__all__ = ["EDiT", "EDiTOptions", "PARTS", "parse_faults"]
