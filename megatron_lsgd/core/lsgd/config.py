"""Cross-site (lsgd) configuration, validated once; every message names its flag."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

COMPRESSIONS = ("none", "int8", "int4", "lowrank-int4")
QUANTIZED_MEAN_VARIANTS = ("auto", "allgather", "alltoall")
H_RULES = ("hide-comm", "scale-with-rank")


@dataclass
class LsgdConfig:
    algorithm: str = "sync"
    warmup_iters: int = 0  # fully synchronous steps before a local-SGD algorithm starts
    # DiLoCo family: H inner steps per round, outer Nesterov SGD on the anchor.
    interval: int = 50
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_offload: bool = False
    dilocox_restart: str = "eager"  # eager: next round starts at θ_g − Δ_t; anchor: at θ_g
    dilocox_apply_step: int = 0  # inner step of round t+1 that applies round t's mean (0: H)
    # DiLoCoX compression.
    compression: str = "none"
    rank: int = 0  # low-rank compression rank (lowrank-int4)
    quant_block: int = 64
    quantized_mean: str = "auto"
    seed: int = 1234  # seeds the low-rank warm start identically on every site
    # DiLoCoX adaptive rank and H.
    adaptive: bool = False
    adaptive_energy: float = 0.9
    adaptive_window: int = 5
    adaptive_min_rank: int = 1
    adaptive_h_rule: str = "hide-comm"
    adaptive_h_min: Optional[int] = None  # default: --lsgd-interval
    adaptive_h_max: Optional[int] = None  # default: 4 x --lsgd-interval
    adaptive_h_slack: float = 1.2
    # Simulated slow inter-site link (tests/benchmarks without tc).
    sim_bandwidth_mbit: float = 0.0
    sim_latency_ms: float = 0.0

    def validate(self, num_sites: int) -> None:
        from megatron_lsgd.core.lsgd.registry import synchronizer_class

        cls = synchronizer_class(self.algorithm)
        if cls.requires_multiple_sites and num_sites < 2:
            raise ValueError(f"--lsgd-algorithm {self.algorithm} needs --num-sites >= 2 (got {num_sites})")
        if self.warmup_iters < 0:
            raise ValueError("--lsgd-warmup-iters must be >= 0")
        if self.interval < 1:
            raise ValueError(f"--lsgd-interval must be >= 1 (got {self.interval})")
        if self.outer_lr <= 0:
            raise ValueError(f"--lsgd-outer-lr must be > 0 (got {self.outer_lr})")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"--lsgd-outer-momentum must be in [0, 1) (got {self.outer_momentum})")
        if self.dilocox_restart not in ("eager", "anchor"):
            raise ValueError(f"--lsgd-dilocox-restart {self.dilocox_restart!r}: choose eager or anchor")
        if self.dilocox_apply_step < 0:
            raise ValueError(f"--lsgd-dilocox-apply-step must be >= 0 (got {self.dilocox_apply_step}; 0 means H)")
        if self.dilocox_apply_step and self.algorithm != "dilocox":
            raise ValueError("--lsgd-dilocox-apply-step needs --lsgd-algorithm dilocox")
        if self.dilocox_apply_step > self.interval:
            raise ValueError(f"--lsgd-dilocox-apply-step {self.dilocox_apply_step} must be <= --lsgd-interval "
                             f"{self.interval}")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"--lsgd-compression {self.compression!r}: choose one of {', '.join(COMPRESSIONS)}")
        if self.compression != "none" and self.algorithm != "dilocox":
            raise ValueError(f"--lsgd-compression {self.compression} needs --lsgd-algorithm dilocox "
                             f"({self.algorithm} sends fp32)")
        if self.compression == "lowrank-int4" and self.rank < 1:
            raise ValueError("--lsgd-compression lowrank-int4 needs --lsgd-rank >= 1")
        if self.compression != "lowrank-int4" and self.rank != 0:
            raise ValueError("--lsgd-rank only applies to --lsgd-compression lowrank-int4")
        if self.quant_block < 2 or self.quant_block % 2:
            raise ValueError(f"--lsgd-quant-block must be even and >= 2 (got {self.quant_block})")
        if self.quantized_mean not in QUANTIZED_MEAN_VARIANTS:
            raise ValueError(f"--lsgd-quantized-mean {self.quantized_mean!r}: choose one of "
                             f"{', '.join(QUANTIZED_MEAN_VARIANTS)}")
        if self.adaptive:
            if self.algorithm != "dilocox":
                raise ValueError("--lsgd-adaptive needs --lsgd-algorithm dilocox")
            if not 0 < self.adaptive_energy <= 1:
                raise ValueError("--lsgd-adaptive-energy must be in (0, 1]")
            if self.adaptive_window < 1:
                raise ValueError("--lsgd-adaptive-window must be >= 1")
            if self.compression == "lowrank-int4" and not 1 <= self.adaptive_min_rank <= self.rank:
                raise ValueError(f"--lsgd-adaptive-min-rank must be in [1, --lsgd-rank {self.rank}]")
            if self.adaptive_h_rule not in H_RULES:
                raise ValueError(f"--lsgd-adaptive-h-rule {self.adaptive_h_rule!r}: choose one of {', '.join(H_RULES)}")
            if self.adaptive_h_rule == "scale-with-rank" and self.compression != "lowrank-int4":
                raise ValueError("--lsgd-adaptive-h-rule scale-with-rank needs --lsgd-compression lowrank-int4")
            if self.adaptive_h_min is None:
                self.adaptive_h_min = self.interval
            if self.adaptive_h_max is None:
                self.adaptive_h_max = 4 * self.interval
            if not 1 <= self.adaptive_h_min <= self.adaptive_h_max:
                raise ValueError(f"--lsgd-adaptive-h-min {self.adaptive_h_min} and --lsgd-adaptive-h-max "
                                 f"{self.adaptive_h_max} must satisfy 1 <= min <= max")
            if self.adaptive_h_slack <= 0:
                raise ValueError("--lsgd-adaptive-h-slack must be > 0")
        if self.sim_bandwidth_mbit < 0:
            raise ValueError("--simulate-inter-site-bandwidth must be >= 0 (Mbit/s, 0: unlimited)")
        if self.sim_latency_ms < 0:
            raise ValueError("--simulate-inter-site-latency must be >= 0 (ms)")
