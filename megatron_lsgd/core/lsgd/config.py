"""Cross-site configuration: the shared option groups and the aggregate every synchronizer
receives. Each algorithm's own knobs live in its module (its `Options` class); the
registry (`catalog.py`) puts the groups on the command line and validates them together.

Shared pieces, each usable by any algorithm that declares it in `Synchronizer.uses`:
- RoundOptions: local-SGD rounds (H) and the synchronous warm-up;
- OuterOptions: the outer Nesterov SGD on the anchor (and its CPU offload);
- CompressionOptions: what crosses sites, compressed with error feedback;
- LinkOptions: the in-process simulated slow link (tests, benchmarks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from megatron_lsgd.core.options import NoOptions, OptionGroup, option

COMPRESSIONS = ("none", "int8", "int4", "lowrank-int4", "topk-2bit")
QUANTIZED_MEAN_VARIANTS = ("auto", "allgather", "alltoall")


@dataclass
class RoundOptions(OptionGroup):
    title = "cross-site rounds (local-SGD algorithms)"
    interval: int = option("--lsgd-interval", 50,
                           "H: inner steps per outer round (the shortest the link hides: at 20 tokens per "
                           "parameter diloco ended +3.2-3.4%% above sync at H = 30 and +4.1-4.9%% at H = 100, "
                           "the model-size ladder's rungs S and M, docs/quality.md)")
    warmup_iters: int = option("--lsgd-warmup-iters", 0,
                               "fully synchronous steps (gradients averaged across sites) before a local-SGD "
                               "algorithm starts")

    def validate(self, **_) -> None:
        if self.warmup_iters < 0:
            raise ValueError("--lsgd-warmup-iters must be >= 0")
        if self.interval < 1:
            raise ValueError(f"--lsgd-interval must be >= 1 (got {self.interval})")


OUTER_DECAY_STYLES = ("linear", "cosine")


@dataclass
class OuterOptions(OptionGroup):
    title = "outer optimizer (anchor + Nesterov SGD, per ZeRO-1 shard)"
    description = ("Schedules count each fragment's own outer steps k = 1, 2, ... (the whole model's rounds "
                   "for diloco-like algorithms, one fragment's syncs for streaming ones): momentum ramps up "
                   "over the warm-up, then lr and momentum move to their final values over the decay window.")
    # Defaults measured (docs/quality.md): 1 / 0 averages the sites' models; the DiLoCo paper's
    # Nesterov 0.7 / 0.9 ended 6.5-22 points worse over the 20-60 outer steps of the toy sweeps,
    # and Nesterov 0.9 at every outer lr from 0.1 to 1.0 3-19 points worse on the ladder's rung S
    # (20 tokens per parameter, data read once, 12-42 outer steps), and Nesterov at its best lr
    # (0.4) behind averaging on two seeds of three at rung M (138 outer steps).
    lr: float = option("--lsgd-outer-lr", 1.0,
                       "outer SGD learning rate (1 with momentum 0: the new anchor is the sites' mean model, "
                       "measured best up to 138 outer steps at 20 tokens per parameter, docs/quality.md; "
                       "the DiLoCo paper: 0.7 with momentum 0.9, for hundreds of outer steps)")
    momentum: float = option("--lsgd-outer-momentum", 0.0,
                             "outer Nesterov momentum (0: plain SGD, no momentum buffer kept)")
    offload: bool = option("--lsgd-outer-offload", False,
                           "keep the anchor and outer momentum of this rank's shard in (pinned) host memory; "
                           "each fragment is brought to the device when used")
    momentum_warmup: int = option("--lsgd-outer-momentum-warmup", 0,
                                  "outer steps W over which momentum ramps linearly: step k uses "
                                  "momentum x min(1, k / W) (0: none)")
    decay_start: int = option("--lsgd-outer-decay-start", 0,
                              "outer step S after which lr and momentum move to --lsgd-outer-min-lr and "
                              "--lsgd-outer-momentum-final (0: never)")
    decay_steps: int = option("--lsgd-outer-decay-steps", 1, "outer steps the decay takes (after S)")
    decay_style: str = option("--lsgd-outer-decay-style", "linear", "shape of the decay",
                              choices=OUTER_DECAY_STYLES)
    min_lr: float = option("--lsgd-outer-min-lr", 0.0, "outer lr at the end of the decay")
    momentum_final: float = option("--lsgd-outer-momentum-final", 0.0, "outer momentum at the end of the decay")

    def validate(self, **_) -> None:
        if self.lr <= 0:
            raise ValueError(f"--lsgd-outer-lr must be > 0 (got {self.lr})")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"--lsgd-outer-momentum must be in [0, 1) (got {self.momentum})")
        if self.momentum_warmup < 0:
            raise ValueError(f"--lsgd-outer-momentum-warmup must be >= 0 (got {self.momentum_warmup})")
        if self.momentum_warmup and self.momentum == 0:
            raise ValueError("--lsgd-outer-momentum-warmup needs --lsgd-outer-momentum > 0")
        if self.decay_start < 0:
            raise ValueError(f"--lsgd-outer-decay-start must be >= 0 (got {self.decay_start})")
        if self.decay_steps < 1:
            raise ValueError(f"--lsgd-outer-decay-steps must be >= 1 (got {self.decay_steps})")
        if self.decay_style not in OUTER_DECAY_STYLES:
            raise ValueError(f"--lsgd-outer-decay-style {self.decay_style!r}: choose one of "
                             f"{', '.join(OUTER_DECAY_STYLES)}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"--lsgd-outer-min-lr must be in [0, --lsgd-outer-lr] (got {self.min_lr})")
        if not 0 <= self.momentum_final <= self.momentum:
            raise ValueError(f"--lsgd-outer-momentum-final must be in [0, --lsgd-outer-momentum] "
                             f"(got {self.momentum_final})")
        if not self.decay_start:
            for flag, value, default in (("--lsgd-outer-decay-steps", self.decay_steps, 1),
                                         ("--lsgd-outer-decay-style", self.decay_style, "linear"),
                                         ("--lsgd-outer-min-lr", self.min_lr, 0.0),
                                         ("--lsgd-outer-momentum-final", self.momentum_final, 0.0)):
                if value != default:
                    raise ValueError(f"{flag} needs --lsgd-outer-decay-start > 0")

    def at(self, k: int):
        """(lr, momentum) of a fragment's k-th outer step (k >= 1)."""
        lr, momentum = self.lr, self.momentum
        if self.momentum_warmup:
            momentum *= min(1.0, k / self.momentum_warmup)
        if self.decay_start and k > self.decay_start:
            frac = min(1.0, (k - self.decay_start) / self.decay_steps)
            # weight of the starting value: linear 1 - frac, cosine (1 + cos(pi frac)) / 2
            keep = 1.0 - frac if self.decay_style == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))
            lr = self.min_lr + (lr - self.min_lr) * keep
            momentum = self.momentum_final + (momentum - self.momentum_final) * keep
        return lr, momentum


@dataclass
class CompressionOptions(OptionGroup):
    title = "cross-site compression (any algorithm that sends gradients or pseudo-gradients)"
    kind: str = option("--lsgd-compression", "none", "what crosses sites, with error feedback per fragment",
                       choices=COMPRESSIONS)
    rank: int = option("--lsgd-rank", 0, "low-rank compression rank (lowrank-int4)")
    quant_block: int = option("--lsgd-quant-block", 64, "values per quantization scale")
    quantized_mean: str = option("--lsgd-quantized-mean", "auto",
                                 "quantized mean across sites (auto: allgather for <= 2 sites, alltoall above)",
                                 choices=QUANTIZED_MEAN_VARIANTS)
    topk_density: float = option("--lsgd-topk-density", 1 / 64,
                                 "topk-2bit: fraction of each chunk sent (kept per chunk: density x chunk, >= 1)")
    topk_chunk: int = option("--lsgd-topk-chunk", 4096, "topk-2bit: values per chunk (one top-k and one scale each)")
    ef_decay: float = option("--lsgd-ef-decay", 1.0,
                             "error-feedback decay beta: each round compresses x + beta x residual "
                             "(1: keep all of it; SparseLoCo uses 0.95)")

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    def validate(self, **_) -> None:
        if self.kind not in COMPRESSIONS:
            raise ValueError(f"--lsgd-compression {self.kind!r}: choose one of {', '.join(COMPRESSIONS)}")
        if self.kind == "lowrank-int4" and self.rank < 1:
            raise ValueError("--lsgd-compression lowrank-int4 needs --lsgd-rank >= 1")
        if self.kind != "lowrank-int4" and self.rank != 0:
            raise ValueError("--lsgd-rank only applies to --lsgd-compression lowrank-int4")
        if self.quant_block < 2 or self.quant_block % 2:
            raise ValueError(f"--lsgd-quant-block must be even and >= 2 (got {self.quant_block})")
        if self.kind != "topk-2bit":
            for flag, value, default in (("--lsgd-topk-density", self.topk_density, 1 / 64),
                                         ("--lsgd-topk-chunk", self.topk_chunk, 4096)):
                if value != default:
                    raise ValueError(f"{flag} only applies to --lsgd-compression topk-2bit")
        elif self.quantized_mean != "auto":
            raise ValueError("--lsgd-quantized-mean does not apply to --lsgd-compression topk-2bit "
                             "(its sparse payloads are always all-gathered)")
        if not 0 < self.topk_density <= 1:
            raise ValueError(f"--lsgd-topk-density must be in (0, 1] (got {self.topk_density})")
        if not 1 <= self.topk_chunk <= 65536:
            raise ValueError(f"--lsgd-topk-chunk must be in [1, 65536] (indices travel as 16 bits; got "
                             f"{self.topk_chunk})")
        if not 0 <= self.ef_decay <= 1:
            raise ValueError(f"--lsgd-ef-decay must be in [0, 1] (got {self.ef_decay})")
        if self.kind == "none" and self.ef_decay != 1.0:
            raise ValueError("--lsgd-ef-decay needs a lossy --lsgd-compression (none keeps no residual)")
        if self.quantized_mean not in QUANTIZED_MEAN_VARIANTS:
            raise ValueError(f"--lsgd-quantized-mean {self.quantized_mean!r}: choose one of "
                             f"{', '.join(QUANTIZED_MEAN_VARIANTS)}")


@dataclass
class LinkOptions(OptionGroup):
    title = "simulated inter-site link (tests and benchmarks without tc)"
    bandwidth_mbit: float = option("--simulate-inter-site-bandwidth", 0.0,
                                   "Mbit/s of a simulated inter-site link (0: unlimited)")
    latency_ms: float = option("--simulate-inter-site-latency", 0.0, "ms added to every inter-site collective")

    def validate(self, **_) -> None:
        if self.bandwidth_mbit < 0:
            raise ValueError("--simulate-inter-site-bandwidth must be >= 0 (Mbit/s, 0: unlimited)")
        if self.latency_ms < 0:
            raise ValueError("--simulate-inter-site-latency must be >= 0 (ms)")


SHARED_GROUPS = {"rounds": RoundOptions, "outer": OuterOptions, "compression": CompressionOptions}


@dataclass(frozen=True)
class RunFacts:
    """What an algorithm's `validate` may need to know about the rest of the run (passed
    as `run=`; None where a caller validates the lsgd options alone)."""

    num_microbatches: int = 1  # per data-parallel rank per step, from --global-batch-size
    pipeline_stages: int = 1
    fp16: bool = False
    sample_budget_flag: Optional[str] = None  # "--train-samples" / "--train-tokens" when the run has one
    batch_schedule_flag: Optional[str] = None  # "--rampup-batch-size" / "--step-batch-size-schedule" when given
    per_token_loss: bool = False  # --calculate-per-token-loss
    tied_embeddings: bool = True  # the word embedding is shared with the output layer (no --untie-...)
    num_layers: Optional[int] = None  # --num-layers: bounds per-layer settings (fragments, a profile's units)


@dataclass
class LsgdConfig:
    """Everything a synchronizer is configured with: the shared pieces and its own options
    (`algo`, an instance of the selected synchronizer's `Options`)."""

    algorithm: str = "sync"
    seed: int = 1234  # the run's --seed: seeds anything that must be drawn identically on every site
    rounds: RoundOptions = field(default_factory=RoundOptions)
    outer: OuterOptions = field(default_factory=OuterOptions)
    compression: CompressionOptions = field(default_factory=CompressionOptions)
    link: LinkOptions = field(default_factory=LinkOptions)
    algo: OptionGroup = field(default_factory=NoOptions)
    # Where a synchronizer may write files of its own (catalog.output_dir: the directory of
    # --json-log, else --tensorboard-dir, else --save); None: write nothing.
    output_dir: Optional[str] = None
