"""Inner-optimizer configuration (AdamW, clipping, LR schedule, loss scaling)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from megatron_lsgd.core.options import AS_GIVEN, OptionGroup, option


@dataclass
class OptimizerConfig(OptionGroup):
    """The inner optimizer's settings; each field with a flag declares it here once (the
    command line's "optimizer" group). Megatron's sample-based and decoupled schedules and its
    NaN check are set from their own flags (training/megatron_compat.py)."""

    title: ClassVar[str] = "optimizer"

    optimizer: str = option(
        "--optimizer", "adam", choices=["adam", "sgd", "muon"], type=AS_GIVEN,
        help="adam: AdamW (decoupled weight decay); sgd: plain SGD, no momentum; muon: Muon for the hidden 2-D "
             "matrices (step lr x 0.2 x sqrt(max dim)), AdamW for embeddings, output layer and 1-D parameters "
             "(with any local-SGD algorithm: MuLoCo)")
    muon_momentum: float = option("--muon-momentum", 0.95, help="--optimizer muon: Nesterov momentum")
    muon_ns_steps: int = option("--muon-ns-steps", 5,
                                help="--optimizer muon: Newton-Schulz iterations (fp32) per matrix and step")
    lr: float = option("--lr", 1e-4, required=True)
    min_lr: float = option("--min-lr", 0.0)
    lr_decay_style: str = option("--lr-decay-style", "linear", choices=["constant", "linear", "cosine"],
                                 type=AS_GIVEN)
    lr_warmup_iters: float = option("--lr-warmup-iters", 0, type=int)  # in lr_unit (a float with --lr-warmup-fraction)
    lr_decay_iters: Optional[int] = option("--lr-decay-iters", None, type=int)  # in lr_unit; default: --train-iters
    weight_decay: float = option("--weight-decay", 0.01)
    adam_beta1: float = option("--adam-beta1", 0.9)
    adam_beta2: float = option("--adam-beta2", 0.999)
    adam_eps: float = option("--adam-eps", 1e-8)
    adam_kernel: str = option(
        "--adam-kernel", "auto", choices=["auto", "foreach", "fused"], type=AS_GIVEN,
        help="AdamW's implementation: auto (fused where every parameter is an fp32 CUDA tensor, foreach elsewhere, "
             "so CPU runs keep their numerics), or either one everywhere. fused on the CPU takes a fifth of "
             "foreach's time and moves the values by a few ulps (a different order of operations)")
    clip_grad: float = option("--clip-grad", 1.0)  # 0 disables clipping
    # fp16 dynamic loss scaling (ignored unless --fp16)
    loss_scale: Optional[float] = option("--loss-scale", None, type=float,
                                         help="fp16 static loss scale (default: dynamic)")
    initial_loss_scale: float = option("--initial-loss-scale", 2.0 ** 32)
    min_loss_scale: float = option("--min-loss-scale", 1.0)
    loss_scale_window: int = option("--loss-scale-window", 1000)
    hysteresis: int = option("--hysteresis", 2)
    # "iterations", or "samples" (Megatron's sample-based schedule: the scheduler advances by
    # each step's global batch, warmup and decay spans count samples).
    lr_unit: str = "iterations"
    # --decoupled-lr / --decoupled-min-lr: the input embedding and output layer follow the same
    # schedule shape between these bounds instead of lr / min_lr.
    decoupled_lr: Optional[float] = None
    decoupled_min_lr: Optional[float] = None
    # Stop (NonFiniteError) instead of applying an update whose gradient norm is NaN/Inf
    # (Megatron's --check-for-nan-in-loss-and-grad; fp16 overflow skips are not affected).
    check_for_nan_in_grad: bool = True

    def validate(self, train_iters: int) -> None:
        if self.optimizer not in ("adam", "sgd", "muon"):
            raise ValueError(f"--optimizer {self.optimizer!r}: choose adam, sgd or muon")
        if self.optimizer != "muon" and (self.muon_momentum != 0.95 or self.muon_ns_steps != 5):
            raise ValueError("--muon-momentum and --muon-ns-steps need --optimizer muon")
        if not 0 <= self.muon_momentum < 1:
            raise ValueError(f"--muon-momentum must be in [0, 1) (got {self.muon_momentum})")
        if not 1 <= self.muon_ns_steps <= 50:
            raise ValueError(f"--muon-ns-steps must be in [1, 50] (got {self.muon_ns_steps})")
        if self.lr <= 0:
            raise ValueError(f"--lr must be > 0 (got {self.lr})")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"--min-lr {self.min_lr} must be in [0, --lr {self.lr}]")
        if self.lr_decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"--lr-decay-style {self.lr_decay_style!r}: choose constant, linear or cosine")
        if self.lr_warmup_iters < 0:
            raise ValueError("--lr-warmup-iters must be >= 0")
        if self.lr_decay_iters is None:
            if train_iters is not None and self.lr_warmup_iters > train_iters:
                raise ValueError(f"--lr-warmup-iters {self.lr_warmup_iters:g} is longer than the run ({train_iters} "
                                 f"iterations): the learning rate would never reach --lr; shorten the warm-up")
            self.lr_decay_iters = train_iters
        if self.lr_decay_iters < self.lr_warmup_iters:
            raise ValueError(f"--lr-decay-iters {self.lr_decay_iters} is shorter than --lr-warmup-iters "
                             f"{self.lr_warmup_iters}")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            raise ValueError("--adam-beta1 and --adam-beta2 must be in [0, 1)")
        if self.adam_eps <= 0:
            raise ValueError("--adam-eps must be > 0")
        if self.weight_decay < 0:
            raise ValueError("--weight-decay must be >= 0")
        if self.clip_grad < 0:
            raise ValueError("--clip-grad must be >= 0 (0 disables clipping)")
        if self.loss_scale is not None and not self.loss_scale > 0:
            raise ValueError(f"--loss-scale {self.loss_scale} must be > 0")
        if not 0 < self.min_loss_scale <= self.initial_loss_scale:
            raise ValueError(f"--min-loss-scale {self.min_loss_scale} and --initial-loss-scale "
                             f"{self.initial_loss_scale} must satisfy 0 < min <= initial")
        if self.loss_scale_window < 1 or self.hysteresis < 1:
            raise ValueError("--loss-scale-window and --hysteresis must be >= 1")
