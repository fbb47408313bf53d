"""The protocol every cross-site synchronizer implements.

The training loop and the pipeline schedule call these methods and never look at which
algorithm is running. One training step, as the default `train_step` composes it:

    train_step(step, data, it)        the synchronizer composes the inner step from its parts:
      step.zero_grads()
      before_forward_backward(it)
      step.compute_grads(data)        the schedule over the micro-batches; inside it:
        before_unit_forward(unit, mb)   per sync unit, just before it computes, every micro-batch
        after_unit_backward(unit, mb)   per sync unit, once per step, when its final gradient
                                        of the step is in main_grad (mb is the last micro-batch)
      step.reduce_in_site()           TP/embedding reduces, then the intra-site buckets
      after_forward_backward(it)      `sync` averages gradients across sites here
      step.apply()                    clip, inner optimizer on this rank's shard, main -> model;
                                      skipped when update_due() is False (an elastic `sync`
                                      step whose mean did not commit)
      after_optimizer_step(it, ok)    DiLoCo-style outer steps go here

    quiesce()                         finish everything in flight; called before evaluation,
                                      before a checkpoint save and when the run stops
    agree_to_stop(progress), meeting() non-lockstep algorithms only (`lockstep = False`): after
                                      every step; sites meet in the synchronizer's own
                                      collectives, and the loop evaluates, saves and stops
                                      only at meetings
    finish_training(it)               once, when training ends (--train-iters or a sample
                                      budget; not --exit-interval / --exit-duration-in-mins):
                                      close open rounds so every site ends with the same model
    ended()                           read by train_step after before_forward_backward: a
                                      Stop when training ended inside the synchronizer (an
                                      elastic site healed to the job's final state, or into
                                      the job's closing exchanges and through them); the step
                                      then returns at once, `StepResult.ended` set, and the
                                      loop stops (finish_training is not called again)

A synchronizer may compose the parts differently (ACCO/DPU overlap a previous round's
reduce + apply with the next compute_grads: they accumulate over several compute_grads
calls, switch the DDP layer between two gradient storages, and apply on a thread of their
own with `apply(grads=..., groups=..., copy_to_model=False)` / `trial_apply`). Unit hooks fire in training only, never in
evaluation. `after_unit_backward` runs inside backward, in the post-accumulate-grad hook of
the unit's last parameter to receive its gradient: on the thread that runs autograd (the
calling thread for CPU tensors; autograd's device thread for CUDA, while the calling
thread waits in backward). At that point the unit's gradient is complete in main_grad but
not reduced inside the site: with --overlap-grad-reduce the reduce of a bucket this
parameter completed has been launched (not finished) just before; without it, intra-site
reduction starts in reduce_in_site().

Everything an algorithm keeps between steps goes through state_dict/load_state_dict, which
the checkpoint calls after quiesce().
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Dict, FrozenSet, List, Optional, Protocol, Tuple

import torch

from megatron_lsgd.core.clock import Clock
from megatron_lsgd.core.lsgd.comm import InterSiteComm
from megatron_lsgd.core.lsgd.config import LsgdConfig
from megatron_lsgd.core.lsgd.membership import AllSites, SiteMembership
from megatron_lsgd.core.options import NoOptions
from megatron_lsgd.core.parallel_state import ProcessGroups

if TYPE_CHECKING:  # types only: the optimizer and the DDP wrapper import nothing from here
    from megatron_lsgd.core.distributed.data_parallel import DistributedDataParallel
    from megatron_lsgd.core.optimizer.sharded_optimizer import ShardedOptimizer


@dataclass(frozen=True)
class MicroBatch:
    """Which micro-batch of the step a unit hook fires in."""

    index: int
    count: int

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


@dataclass
class StepResult:
    losses: List[Dict[str, torch.Tensor]]  # what the loss function reported, per micro-batch (last stage)
    update_successful: bool  # False: fp16 overflow, the inner update was skipped
    grad_norm: Optional[float]
    num_microbatches: int  # micro-batches this rank computed (ACCO varies it per site)
    # False when sites may have computed different numbers of micro-batches in this step
    # (ACCO/DPU's adaptive accumulation): the loop then counts the job's samples as the sum
    # of every site's own count (exchanged where it logs and saves) instead of this rank's
    # count times the number of sites.
    same_count_on_every_site: bool = True
    # The learning rate to log for this step, where the scheduler steps on another thread
    # (ACCO/DPU's worker): the LR of the last update this thread has waited for, read under
    # that handover. None: the loop reads the scheduler after the step (it owns it).
    lr: Optional[float] = None
    # Training ended inside the step, before it computed anything (Synchronizer.ended): no
    # inner step was taken, the loop stops, and the state held is the final one.
    ended: Optional["Stop"] = None

    @classmethod
    def none_taken(cls, ended: "Stop") -> "StepResult":
        """A step that ended training before computing (`ended`)."""
        return cls(losses=[], update_successful=True, grad_norm=None, num_microbatches=0, ended=ended)


@dataclass(frozen=True)
class Progress:
    """What a non-lockstep synchronizer sees when deciding whether to stop."""

    iteration: int  # this site's inner steps so far
    site_samples: int  # samples this site has consumed
    elapsed_s: float  # since start-up
    train_iters: int  # --train-iters (or derived from a budget): a cap on this site's steps
    train_samples: Optional[int]  # the job's sample budget, all sites together (None: none given)
    exit_duration_s: Optional[float]  # --exit-duration-in-mins in seconds (None: none given)
    global_batch_size: int = 0  # samples of one global step (all sites); a site's step is 1/S of it


@dataclass(frozen=True)
class Stop:
    ends_training: bool  # True: finish_training runs (the final model); False: a pause to resume from
    reason: str  # for the log, names the flag


@dataclass(frozen=True)
class Meeting:
    """Where the sites of a non-lockstep run met (every rank of every site holds the same one).

    Sites of a non-lockstep algorithm take different numbers of steps; they only agree on
    anything at meetings, which the synchronizer holds in its own collectives. The loop
    evaluates, saves checkpoints and stops only there, naming the point by the job's
    progress (`samples` // global batch)."""

    site_iterations: Tuple[int, ...]  # each site's inner steps so far
    site_samples: Tuple[int, ...]  # each site's consumed samples
    time_up: bool = False  # some site's --exit-duration-in-mins has passed
    synced: bool = False  # the synchronizer synchronizes parameters at this meeting
    # The job's samples as the synchronizer counts them when sites may be lost and come back
    # (elastic sites): each sample once, so not every site's position summed. None: the sum.
    counted: Optional[int] = None

    @property
    def samples(self) -> int:
        """The job's consumed samples, all sites together."""
        return sum(self.site_samples) if self.counted is None else self.counted


def stop_at_meeting(meeting: Meeting, progress: Progress) -> Optional[Stop]:
    """The stop rule every non-lockstep synchronizer applies at a meeting, identically on
    every rank (the meeting is agreed):

    - the job's budget (`progress.train_samples`, or --train-iters x global batch when no
      budget was given) has less than one global batch left: training ends;
    - some site's --exit-duration-in-mins has passed: the run pauses (a checkpoint to resume from).
    """
    gbs = progress.global_batch_size
    budget = progress.train_samples if progress.train_samples is not None else progress.train_iters * gbs
    if budget - meeting.samples < max(gbs, 1):
        flag = "--train-samples/--train-tokens" if progress.train_samples is not None else "--train-iters"
        return Stop(True, f"{flag} budget of {budget} samples reached ({meeting.samples} consumed, site steps "
                          f"{'/'.join(map(str, meeting.site_iterations))})")
    if meeting.time_up:
        minutes = (progress.exit_duration_s or 0.0) / 60.0
        return Stop(False, f"--exit-duration-in-mins {minutes:g} on some site")
    return None


class InnerStep(Protocol):
    """The parts of one inner step (training/inner_step.py implements it)."""

    def zero_grads(self) -> None: ...

    def compute_grads(self, data_iterator, num_microbatches: Optional[int] = None, *,
                      loss_divisor: Optional[int] = None, accumulate_only: bool = False
                      ) -> List[Dict[str, torch.Tensor]]:
        """Forward and backward over the micro-batches (default: the configured count);
        gradients accumulate in the fp32 main_grad buffer. `loss_divisor` (default: the
        call's count) divides each micro-batch's loss; `accumulate_only` keeps the DDP layer
        from treating the call's last micro-batch as the step's last (no early bucket
        reduce, no unit-backward notifications): for a step accumulated over several calls."""

    def reduce_in_site(self) -> None: ...

    def apply(self, *, grads: Optional[List[torch.Tensor]] = None, groups: Optional[ProcessGroups] = None,
              copy_to_model: bool = True) -> Tuple[bool, Optional[float]]:
        """Clip, step the inner optimizer at the scheduled LR (advancing the schedule on
        success), copy main parameters into the model. Returns (update_successful, grad_norm).
        `grads`, `groups`, `copy_to_model`: see ShardedOptimizer.step."""

    def trial_apply(self, out: List[torch.Tensor], *, grads: Optional[List[torch.Tensor]] = None,
                    groups: Optional[ProcessGroups] = None) -> Tuple[bool, Optional[float]]:
        """What apply() would make of the main shards, at the LR apply() would use, written
        into `out`; nothing is committed (ShardedOptimizer.trial_step)."""

    @property
    def num_microbatches(self) -> int: ...

    @property
    def current_lr(self) -> float:
        """The learning rate of the last update apply() made (read it on the thread that
        calls apply(), or after waiting for it)."""


@dataclass
class SyncContext:
    """What a synchronizer may touch, handed over once at construction."""

    pgs: ProcessGroups
    config: LsgdConfig
    models: List[DistributedDataParallel]  # this rank's model chunks (grad buffers)
    optimizer: ShardedOptimizer  # views(units), copy_main_to_model_params(views), counted_spans, state
    comm: InterSiteComm
    units: List[object] = field(default_factory=list)  # SyncUnits of this stage, forward order
    # Which sites take part in each outer round (fault tolerance: fault_tolerance/); the
    # default is every site, every round.
    membership: SiteMembership = field(default_factory=AllSites)

    @property
    def clock(self) -> Clock:
        """The run's clock (the one the inter-site comm keeps): every time an algorithm reads."""
        return self.comm.clock

    @property
    def device(self):
        """The run's device: where a synchronizer builds its tensors (never a bare host tensor:
        the world and site groups are NCCL on GPUs; comm stages what dp_inter needs elsewhere)."""
        return self.comm.devices.run

    # ---- model facts (what the synchronizer may know of the model it serves) --------------------
    @property
    def layer_indices(self) -> List[int]:
        """The global indices of this stage's transformer layers (its `layers.<i>` units), in
        forward order."""
        return [int(u.name.split(".", 1)[1]) for u in self.units if u.name.startswith("layers.")]

    def model_layers(self) -> Tuple[int, bool]:
        """(global transformer layers, tied embeddings) of the model the synchronizer serves."""
        for m in self.models:
            cfg = getattr(getattr(m, "module", m), "config", None)
            if cfg is not None and hasattr(cfg, "num_layers"):
                return int(cfg.num_layers), not getattr(cfg, "untie_embeddings_and_output_weights", False)
        layers = self.layer_indices
        return (max(layers) + 1 if layers else 1), False

    @staticmethod
    def is_tied_embedding(param) -> bool:
        """Whether `param` is the word embedding tied between the first and the last pipeline
        stage (either stage's copy; the last stage's gradient is reduced with the first's)."""
        return getattr(param, "shared_embedding", False)

    @property
    def uses_muon(self) -> bool:
        """Whether --optimizer muon steps the hidden matrices (it assembles each over tp)."""
        return getattr(self.optimizer, "muon", None) is not None


class Synchronizer:
    name: ClassVar[str] = ""
    # The algorithm's own options (an OptionGroup dataclass; its flags form one --help group).
    Options: ClassVar[type] = NoOptions
    # Shared option groups it reads (config.SHARED_GROUPS): "rounds", "outer", "compression".
    uses: ClassVar[FrozenSet[str]] = frozenset()
    # True when the algorithm only makes sense with more than one site (an error at start).
    requires_multiple_sites: ClassVar[bool] = False
    # True when it runs with one site but then does nothing (a warning at start).
    inert_with_one_site: ClassVar[bool] = False
    # False when sites take different numbers of inner steps (A-EDiT): the loop then cannot
    # agree on stopping by itself and asks `agree_to_stop` instead.
    lockstep: ClassVar[bool] = True
    # Which unit hooks the loop must wire (registering module hooks costs time per call).
    uses_unit_forward_hooks: ClassVar[bool] = False
    uses_unit_backward_hooks: ClassVar[bool] = False
    # True when the inner optimizer steps while the model computes (ACCO/DPU): the loop
    # then gives the optimizer fp32 main parameters apart from the model's even for fp32
    # models, so a step never writes into parameters a forward pass is reading.
    overlaps_optimizer_step: ClassVar[bool] = False
    # True when it issues collectives from a thread of its own (ACCO/DPU): its inter-site
    # backend is then gloo (devices.choose_inter_site_backend), so that on GPUs only the
    # compute thread launches NCCL kernels.
    communicates_from_a_thread: ClassVar[bool] = False
    # True when its state is organised by pipeline stage (fragments or schedules made of a
    # stage's units): tools/checkpoint/convert.py then keeps the pipeline-parallel size.
    state_follows_pipeline: ClassVar[bool] = False
    # Elastic sites (--lsgd-fault-tolerance torchft): None when its outer rounds run through
    # SiteMembership (quorum, commit or roll back; its settings that cannot:
    # refused_with_fault_tolerance), else why not, in a few words (the run's one error line,
    # docs/fault_tolerance.md), as the other shapes of sites are declared below.
    fault_tolerance_refusal: ClassVar[Optional[str]] = "its rounds do not run through SiteMembership's quorums yet"
    # Sites of different data-parallel sizes (--site-data-parallel-sizes): None when the
    # algorithm supports them (its means weighted by each site's tokens, exchanged lane by
    # lane: site_split.SiteSplit), else why not, in a few words (the run's one error line).
    unequal_sites_refusal: ClassVar[Optional[str]] = \
        "its cross-site exchange is not cut into lanes for sites of different sizes yet"
    # Both at once (elastic sites of different sizes: a torchft Manager per lane,
    # fault_tolerance/lanes.py): None when supported, else why not (one error line).
    elastic_unequal_sites_refusal: ClassVar[Optional[str]] = \
        "its elastic rounds on sites of different sizes have not been run and checked yet"
    # The --lsgd-compression kinds it weights by tokens and cuts into lanes with such sites
    # (any other is refused there, naming the flag).
    unequal_sites_compressions: ClassVar[Tuple[str, ...]] = ()
    # Sites of different TP x PP (--site-tensor/pipeline-model-parallel-sizes): None when
    # what it sends across sites goes through the layout-free form (canonical_exchange.py).
    mixed_layouts_refusal: ClassVar[Optional[str]] = \
        "what it sends across sites is laid out like the rank's own shard, not in the layout-free form yet"

    @classmethod
    def refused_with_fault_tolerance(cls, config: LsgdConfig) -> List[Tuple[str, str]]:
        """(flag, why) for each of the run's settings that this algorithm's elastic rounds
        (--lsgd-fault-tolerance torchft) cannot honour; each becomes an error naming its flag."""
        return []

    @classmethod
    def refused_with_elastic_unequal_sites(cls, config: LsgdConfig) -> List[Tuple[str, str]]:
        """The same for elastic sites of different sizes (a heal re-cuts per_part_state only)."""
        return []

    def __init__(self, ctx: SyncContext):
        self.ctx = ctx
        # Whether there is anyone to synchronize with (more than one site); single-site
        # tests of an algorithm's arithmetic may switch it on.
        self.active = ctx.comm.num_sites > 1

    # ---- the step --------------------------------------------------------------------------
    def train_step(self, step: InnerStep, data_iterator, iteration: int) -> StepResult:
        """Today's synchronous step, with a hook between each part."""
        step.zero_grads()
        self.before_forward_backward(iteration)
        ended = self.ended()
        if ended is not None:
            return StepResult.none_taken(ended)
        losses = step.compute_grads(data_iterator)
        step.reduce_in_site()
        self.after_forward_backward(iteration)
        ok, norm = step.apply() if self.update_due() else (False, None)
        self.after_optimizer_step(iteration, ok)
        return StepResult(losses, ok, norm, step.num_microbatches)

    def microbatches_per_step_bound(self, configured: int) -> int:
        """The most micro-batches one rank may compute in one train_step (the loop sizes the
        training dataset for it); `configured` is --global-batch-size's count."""
        return configured

    # ---- hooks (defaults do nothing) -----------------------------------------------------
    def before_forward_backward(self, iteration: int) -> None:
        pass

    def before_unit_forward(self, unit, microbatch: MicroBatch) -> None:
        pass

    def after_unit_backward(self, unit, microbatch: MicroBatch) -> None:
        pass

    def after_forward_backward(self, iteration: int) -> None:
        pass

    def after_optimizer_step(self, iteration: int, update_successful: bool) -> None:
        pass

    def update_due(self) -> bool:
        """Read after after_forward_backward: False when this step's inner update must not be
        applied (an elastic `sync` step whose cross-site mean did not commit: every site of
        the quorum skips it, as an fp16 overflow is skipped, so all stay on one model)."""
        return True

    def quiesce(self) -> None:
        """Finish all communication in flight so state_dict() is complete and the model
        evaluated or saved is consistent. Must not change the numbers the run produces:
        a finished reduction is applied when it would have been anyway. A sync that is
        already decided but carried out lazily (edit's, in the next forward) is carried out
        here, so evaluation and checkpoints see the synced model at a sync boundary."""

    def finish_training(self, iteration: int) -> None:
        pass

    def ended(self) -> Optional[Stop]:
        """A Stop when training ended inside the synchronizer rather than by the loop's count:
        the membership's `ended_by` (an elastic site healed to the job's final state, or healed
        into the job's closing exchanges and through them with the others). The site holds
        the job's final state; the loop stops without another step or finish_training."""
        heal = self.ctx.membership.ended_by
        return Stop(True, heal.reason()) if heal is not None else None

    def agree_to_stop(self, progress: Progress) -> Optional[Stop]:
        """Non-lockstep algorithms only: called after every inner step; return a Stop, on
        every rank of every site, after the step at which that rank stops (sites agree
        where they meet, in the synchronizer's own collectives; `stop_at_meeting` is the
        shared rule)."""
        raise TypeError(f"--lsgd-algorithm {self.name} is not lockstep and must implement agree_to_stop")

    def meeting(self) -> Optional[Meeting]:
        """Non-lockstep algorithms only: the Meeting the sites held after the latest step
        (read by the loop right after agree_to_stop), or None when they did not meet."""
        return None

    def healed_position(self) -> Tuple[int, int]:
        """Non-lockstep algorithms under fault tolerance only: right after a heal (this
        synchronizer loaded a live peer's state), this site's own (iteration, consumed
        samples of its stream) as the job last counted them. Each site reads its own stream
        at its own pace, so the peer's position, which a lockstep site takes, is not this
        site's; the meeting loop asks this instead (MeetingLoop.after_heal)."""
        raise TypeError(f"--lsgd-algorithm {self.name} is not lockstep and must implement healed_position")

    # ---- state and statistics ---------------------------------------------------------------
    def state_dict(self) -> Dict:
        """Everything kept between steps. It only reads: the caller has quiesced (the
        checkpoint does), so nothing is in flight; `require_quiesced` says so loudly."""
        return {}

    def per_part_state(self, state: Dict) -> List[Tuple[List[torch.Tensor], object]]:
        """The lists of `state` (a state_dict()) laid out on this rank's part of a set of units
        (one tensor per non-empty range of SiteSplit.mine(views)), each with the whole-site
        ShardViews it is a part of: what a heal into a site of another size re-cuts for the
        receiving rank (fault_tolerance/lane_heal.py). Values in flight, say. The same entries,
        in the same order, on every rank of a site (an empty list where its part is empty)."""
        return []

    def per_parameter_state(self) -> Dict[str, List[object]]:
        """The entries of state_dict() that hold per-parameter values, for tools/checkpoint/
        convert.py to reshard with the optimizer state: path (keys joined by '/') -> the
        ShardViews on which this rank's values are its own. Each such entry is a list of
        tensors laid out like the optimizer's main shards (one per main shard), or an empty
        list. convert.py carries everything else as it is, so it must not depend on the
        layout; it refuses to reshard the algorithm's state when the rest differs between
        the ranks of a site or holds a tensor with values (error feedback, values in flight)."""
        return {}

    def held_alike(self) -> List[torch.Tensor]:
        """What every site holds alike at a committed round (--lsgd-ft-digests hashes it at
        each quorum, and chaos.py compares the sites): the anchor and outer momentum, or,
        without them (`sync`, whose every committed step applies one mean on every site), the
        model's main shards."""
        outer = getattr(self, "outer", None)
        if outer is not None:
            return list(outer.anchors) + list(outer.momenta)
        return list(self.ctx.optimizer.main_param_shards())

    def require_quiesced(self, in_flight: bool) -> None:
        if in_flight:
            raise RuntimeError(f"{self.name}: state_dict() with communication in flight; call quiesce() first "
                               "(the checkpoint does)")

    def load_state_dict(self, state: Dict) -> None:
        pass

    def stats(self) -> Dict[str, float]:
        """Algorithm-specific numbers for the log line (comm totals come from ctx.comm)."""
        return {}
