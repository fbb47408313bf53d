"""The protocol every cross-site synchronizer implements.

The training loop and the pipeline schedule call these hooks and never look at which
algorithm is running. Hook points, in the order a step meets them:

    wrap_train_step(step_fn)       once: an algorithm may own the inner step (ACCO/DPU)
    before_forward_backward(it)    per global step
    before_unit_forward(unit)      per sync unit (embedding, layer, head), just before it
                                   computes, for every micro-batch (EDiT's forward sync)
    after_unit_backward(unit)      per sync unit, once per step, when its final gradient
                                   of the step is accumulated (DreamDDP)
    after_forward_backward(it)     gradients reduced inside the site (the `sync` baseline
                                   all-reduces them across sites here)
    after_optimizer_step(it, ok)   inner optimizer has stepped (DiLoCo's outer step)
    finish_training(it)            once, when --train-iters is reached (not on --exit-interval):
                                   finish any round or reduction still open so every site ends
                                   with the same model, before the final evaluation and save

Everything an algorithm keeps between steps goes through state_dict/load_state_dict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, ClassVar, Dict, List

from megatron_lsgd.core.lsgd.comm import InterSiteComm
from megatron_lsgd.core.lsgd.config import LsgdConfig
from megatron_lsgd.core.parallel_state import ProcessGroups


@dataclass
class SyncContext:
    """What a synchronizer may touch, handed over once at construction."""

    pgs: ProcessGroups
    config: LsgdConfig
    models: List[object]  # DistributedDataParallel chunks (grad buffers, sync units)
    optimizer: object  # ShardedOptimizer: main_param_shards(), state
    comm: InterSiteComm
    units: List[object] = field(default_factory=list)  # SyncUnits of this stage, forward order


class Synchronizer:
    name: ClassVar[str] = ""
    # True when the algorithm only makes sense with more than one site.
    requires_multiple_sites: ClassVar[bool] = False

    def __init__(self, ctx: SyncContext):
        self.ctx = ctx

    # ---- hooks (defaults do nothing) -----------------------------------------------------
    def wrap_train_step(self, step_fn: Callable) -> Callable:
        return step_fn

    def before_forward_backward(self, iteration: int) -> None:
        pass

    def before_unit_forward(self, unit) -> None:
        pass

    def after_unit_backward(self, unit) -> None:
        pass

    def after_forward_backward(self, iteration: int) -> None:
        pass

    def after_optimizer_step(self, iteration: int, update_successful: bool) -> None:
        pass

    def finish_training(self, iteration: int) -> None:
        pass

    # Which hooks the loop must wire (registering module hooks costs time per call).
    uses_unit_forward_hooks: ClassVar[bool] = False
    uses_unit_backward_hooks: ClassVar[bool] = False

    # ---- state and statistics ---------------------------------------------------------------
    def state_dict(self) -> Dict:
        return {}

    def load_state_dict(self, state: Dict) -> None:
        pass

    def stats(self) -> Dict[str, float]:
        """Algorithm-specific numbers for the log line (comm totals come from ctx.comm)."""
        return {}


_REGISTRY: Dict[str, type] = {}


def register(cls: type) -> type:
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a `name`")
    if cls.name in _REGISTRY:
        raise ValueError(f"synchronizer {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def registered_algorithms() -> List[str]:
    return sorted(_REGISTRY)


def synchronizer_class(name: str) -> type:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"--lsgd-algorithm {name!r}: choose one of {', '.join(registered_algorithms())}") from None
