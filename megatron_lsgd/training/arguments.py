"""Megatron-compatible command line -> typed, validated configuration.

`parse_args` only parses. `build_config` turns the namespace into dataclasses and checks
them once against the world size; every error names the flag to change.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch

from megatron_lsgd import cli
from megatron_lsgd.core.datasets.config import DataConfig
from megatron_lsgd.core.distributed.data_parallel import DDPConfig
from megatron_lsgd.core.lsgd import catalog
from megatron_lsgd.core.lsgd.config import LsgdConfig, RunFacts
from megatron_lsgd.core.lsgd.fault_tolerance.options import FaultToleranceOptions
from megatron_lsgd.core.lsgd.options import finite_float
from megatron_lsgd.core.optimizer.config import OptimizerConfig
from megatron_lsgd.core.parallel_state import ParallelDims
from megatron_lsgd.core.transformer.config import TransformerConfig
from megatron_lsgd.training.checkpointing.config import CheckpointConfig
from megatron_lsgd.training.guard import startup_checks
from megatron_lsgd.training.megatron_compat import (CompatConfig, add_megatron_compat_args,
                                                    apply_megatron_compat_args, normalize_megatron_args)
from megatron_lsgd.training.scenario import SimulationOptions, load_scenario
from megatron_lsgd.training.stragglers import SLOW_MODES, StragglerConfig
from megatron_lsgd.training.tokenizer.config import TOKENIZER_TYPES, TokenizerConfig


@dataclass
class TrainingConfig:
    micro_batch_size: int = 1
    global_batch_size: Optional[int] = None
    train_iters: int = 100  # given, or derived from a sample/token budget
    train_samples: Optional[int] = None  # the job's sample budget (all sites), when given as one
    exit_duration_in_mins: Optional[float] = None
    eval_interval: int = 1000
    eval_iters: int = 10
    full_validation: bool = False  # every evaluation covers the whole validation split, the same samples
    skip_train: bool = False  # --skip-train: evaluate the held-out sets only
    log_interval: int = 100
    exit_interval: Optional[int] = None
    seed: int = 1234
    bf16: bool = False
    fp16: bool = False
    compile: bool = False  # --compile: each transformer layer's forward compiled (core/transformer/compile.py)
    tensorboard_dir: Optional[str] = None
    json_log: Optional[str] = None  # one JSON object per log interval (benchmarks)
    distributed_backend: Optional[str] = None  # None: nccl with CUDA, gloo otherwise
    inter_site_backend: Optional[str] = None  # dp_inter groups; None: nccl with CUDA, gloo otherwise
    distributed_timeout_minutes: int = 10

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32


@dataclass
class RunConfig:
    model: TransformerConfig
    dims: ParallelDims
    ddp: DDPConfig
    optimizer: OptimizerConfig
    training: TrainingConfig
    data: DataConfig
    tokenizer: TokenizerConfig
    lsgd: LsgdConfig
    num_microbatches: int = 1
    raw_args: Optional[argparse.Namespace] = field(default=None, repr=False)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    simulation: SimulationOptions = field(default_factory=SimulationOptions)  # --simulate-clock
    compat: CompatConfig = field(default_factory=CompatConfig)  # Megatron run-time options (megatron_compat.py)
    fault_tolerance: FaultToleranceOptions = field(default_factory=FaultToleranceOptions)  # elastic sites


def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True, help="transformer layers")
    g.add_argument("--hidden-size", type=int, required=True, help="width of the residual stream")
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="MLP width; default 4 x hidden (GELU) or about 8/3 x hidden rounded to 64 (SwiGLU)")
    g.add_argument("--num-attention-heads", type=int, required=True, help="query heads per layer")
    g.add_argument("--group-query-attention", action="store_true",
                   help="share key/value heads among groups of query heads (with --num-query-groups)")
    g.add_argument("--num-query-groups", type=int, default=None,
                   help="key/value heads under --group-query-attention")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="width of one attention head; default --hidden-size / --num-attention-heads")
    g.add_argument("--seq-length", type=int, required=True, help="tokens per training sample")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="positions a learned position embedding holds; default --seq-length")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute",
                   help="learned absolute positions (GPT-2) or rotary embeddings (Llama)")
    g.add_argument("--rotary-base", type=finite_float, default=10000.0, help="rope: base of the rotary frequencies")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm",
                   help="normalization before attention, MLP and the output layer")
    g.add_argument("--norm-epsilon", type=finite_float, default=1e-5, help="epsilon of the normalization")
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (gated SiLU) instead of GELU")
    g.add_argument("--disable-bias-linear", action="store_true", help="no bias in the linear layers (Llama)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="a separate output layer instead of the word embedding reused")
    g.add_argument("--hidden-dropout", type=finite_float, default=0.1,
                   help="dropout after attention and MLP, before the residual add")
    g.add_argument("--attention-dropout", type=finite_float, default=0.1, help="dropout on the attention weights")
    g.add_argument("--init-method-std", type=finite_float, default=0.02,
                   help="standard deviation of the normal weight initialization")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="recompute activations in backward: full transformer layers (with --recompute-method), "
                        "or selective: the core attention of every layer")
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None,
                   help="full: uniform recomputes every layer in chunks of --recompute-num-layers; block only "
                        "the first --recompute-num-layers layers of each pipeline stage")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="layers per recomputed chunk (uniform) or layers recomputed per stage (block)")


def _parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-sites", type=int, default=1,
                   help="split data parallelism into S sites joined by slow links (ranks of a site are contiguous)")
    g.add_argument("--site-data-parallel-sizes", default=None, metavar="DP_0,DP_1,...",
                   help="data-parallel size of each site, comma-separated, one per --num-sites (sum x TP x PP = "
                        "world size; default: the world split evenly). Site s gets DP_s / DP of every global "
                        "batch and weight DP_s / DP in every mean across sites (sync, diloco, dilocox, "
                        "streaming-diloco and cocodc; docs/heterogeneous_sites.md)")
    g.add_argument("--site-tensor-model-parallel-sizes", default=None, metavar="TP_0,TP_1,...",
                   help="tensor-parallel size of each site, comma-separated, one per --num-sites, instead of "
                        "--tensor-model-parallel-size (diloco, dilocox, streaming-diloco and cocodc only: they "
                        "exchange in a layout-free form; docs/heterogeneous_sites.md)")
    g.add_argument("--site-pipeline-model-parallel-sizes", default=None, metavar="PP_0,PP_1,...",
                   help="pipeline-parallel size of each site, as --site-tensor-model-parallel-sizes. Every site "
                        "has world / (TP_0 x PP_0 + TP_1 x PP_1 + ...) data-parallel replicas, unless "
                        "--site-data-parallel-sizes gives each its own")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="ZeRO-1: shard the inner optimizer state over the data-parallel ranks of a site")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="launch each bucket's intra-site gradient reduction as soon as backward fills it")
    g.add_argument("--ddp-bucket-size", type=int, default=40_000_000, help="elements per gradient bucket")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl when CUDA is available, gloo otherwise")
    g.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="where the model computes; default: cuda when available and the backend is not gloo. "
                        "cuda with --distributed-backend gloo shares the GPUs among the ranks (several ranks "
                        "per GPU, e.g. two one-rank sites on one GPU)")
    g.add_argument("--inter-site-backend", choices=["nccl", "gloo"], default=None,
                   help="backend of the groups that cross sites (dp_inter); with gloo on GPUs, payloads go "
                        "through pinned host buffers. Default: nccl when the run uses CUDA, gloo otherwise and "
                        "under --lsgd-algorithm acco/dpu (whose worker thread communicates on gloo groups). "
                        "Under --lsgd-fault-tolerance torchft it is torchft's group's backend")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)


def _training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, required=True)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="default: micro batch size x data-parallel size")
    g.add_argument("--train-iters", type=int, default=None,
                   help="inner steps to train (or give a budget: --train-samples / --train-tokens)")
    g.add_argument("--train-samples", type=int, default=None,
                   help="train on this many samples in total, all sites together (iterations = samples // "
                        "global batch size)")
    g.add_argument("--train-tokens", type=int, default=None,
                   help="train on this many tokens in total, all sites together (samples = tokens // "
                        "--seq-length)")
    g.add_argument("--exit-duration-in-mins", type=finite_float, default=None,
                   help="stop (saving a checkpoint with --save) once this many minutes have passed since start-up; "
                        "every rank stops at the same iteration and a resumed run continues exactly")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100, help="0 disables evaluation")
    g.add_argument("--full-validation", action="store_true",
                   help="every evaluation runs over the whole validation split, the same samples each time, "
                        "so the points of a validation curve (and runs with other seeds) are comparable; "
                        "--eval-iters then only switches evaluation on (> 0) or off (0)")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM (a scheduler's notice before its time limit), save a checkpoint at the next "
                        "iteration, on every rank together, and exit 0; without it SIGTERM stops the run at once")
    g.add_argument("--skip-train", action="store_true",
                   help="train nothing: evaluate the model (from --load) on the validation and test sets and exit; "
                        "no --train-iters needed")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--compile", action="store_true",
                   help="compile each transformer layer's forward with torch.compile (regional: the layers share "
                        "one graph, hooks stay at layer boundaries); after the second step, once, prints the first "
                        "step's graphs and graph breaks and the second's breaks and recompilations "
                        "(docs/performance.md)")
    g.add_argument("--tensorboard-dir", type=str, default=None)


def _optimizer_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimizer")
    g.add_argument("--optimizer", choices=["adam", "sgd", "muon"], default="adam",
                   help="adam: AdamW (decoupled weight decay); sgd: plain SGD, no momentum; muon: Muon for the "
                        "hidden 2-D matrices (step lr x 0.2 x sqrt(max dim)), AdamW for embeddings, output layer "
                        "and 1-D parameters (with any local-SGD algorithm: MuLoCo)")
    g.add_argument("--muon-momentum", type=finite_float, default=0.95, help="--optimizer muon: Nesterov momentum")
    g.add_argument("--muon-ns-steps", type=int, default=5,
                   help="--optimizer muon: Newton-Schulz iterations (fp32) per matrix and step")
    g.add_argument("--lr", type=finite_float, required=True)
    g.add_argument("--min-lr", type=finite_float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="linear")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--weight-decay", type=finite_float, default=0.01)
    g.add_argument("--adam-beta1", type=finite_float, default=0.9)
    g.add_argument("--adam-beta2", type=finite_float, default=0.999)
    g.add_argument("--adam-eps", type=finite_float, default=1e-8)
    g.add_argument("--clip-grad", type=finite_float, default=1.0)
    g.add_argument("--loss-scale", type=finite_float, default=None, help="fp16 static loss scale (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=finite_float, default=2.0 ** 32)
    g.add_argument("--min-loss-scale", type=finite_float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)


def _data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data and tokenizer")
    g.add_argument("--data-path", nargs="*", default=[],
                   help="prefix ... or weight prefix weight prefix ... (blended)")
    g.add_argument("--split", type=str, default="969,30,1",
                   help="train,valid,test shares of each --data-path file (contiguous document ranges)")
    for split, what in (("train", "training"), ("valid", "validation"), ("test", "test")):
        g.add_argument(f"--{split}-data-path", nargs="*", default=[],
                       help=f"the {what} set's own files, used whole (prefix ... or weight prefix ...); instead of "
                            f"--data-path and --split" + (": evaluated once at the end of training" if split == "test"
                                                          else ""))
    g.add_argument("--data-cache-path", type=str, default=None)
    g.add_argument("--mock-data", action="store_true", help="deterministic synthetic tokens")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--num-workers", type=int, default=0)
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None)
    g.add_argument("--tokenizer-model", type=str, default=None)
    g.add_argument("--vocab-file", type=str, default=None)
    g.add_argument("--merge-file", type=str, default=None)
    g.add_argument("--vocab-size", type=int, default=None,
                   help="NullTokenizer vocabulary size; TikTokenizer: its size (default there: 131072)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)


def _checkpoint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpointing (docs/checkpointing.md)")
    g.add_argument("--save", type=str, default=None, help="directory to save checkpoints to")
    g.add_argument("--load", type=str, default=None,
                   help="directory to resume from (its latest_checkpointed_iteration.txt); may equal --save")
    g.add_argument("--save-interval", type=int, default=None, help="iterations between checkpoints")
    g.add_argument("--no-save-optim", action="store_true", help="save the model and RNG only")
    g.add_argument("--no-load-optim", action="store_true",
                   help="do not load optimizer, LR scheduler and synchronizer state")
    g.add_argument("--no-load-rng", action="store_true", help="do not load RNG states")
    g.add_argument("--finetune", action="store_true",
                   help="load the model only and start at iteration 0 (fresh optimizer, scheduler, RNG, data)")
    g.add_argument("--no-verify-checkpoint-checksums", action="store_true",
                   help="skip comparing every loaded file with the SHA-256 recorded in metadata.json at save time")


def _emulation_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("benchmarking and heterogeneity emulation")
    g.add_argument("--json-log", type=str, default=None,
                   help="append one JSON object per log interval (and one at the end) to this file")
    g.add_argument("--simulate-slow-ranks", type=str, default=None,
                   help="comma-separated global ranks made slower by --slow-factor x their own compute time")
    g.add_argument("--slow-factor", type=finite_float, default=2.0,
                   help="a slow rank's step takes this many times as long")
    g.add_argument("--slow-mode", choices=SLOW_MODES, default="consistent",
                   help="consistent: slow every step; random: slow on a step with --slow-probability (seeded)")
    g.add_argument("--slow-probability", type=finite_float, default=0.5,
                   help="random mode: chance a slow rank lags a step")


def build_parser(extra_args_provider: Optional[Callable] = None) -> argparse.ArgumentParser:
    p = cli.ArgumentParser(
        description="megatron_lsgd: 3D-parallel GPT pre-training across sites",
        allow_abbrev=False, formatter_class=cli.HelpFormatter)
    for add in (_model_args, _parallel_args, _training_args, _optimizer_args, _data_args, catalog.add_arguments,
                FaultToleranceOptions.add_arguments, _checkpoint_args, _emulation_args, SimulationOptions.add_arguments, add_megatron_compat_args):
        add(p)
    if extra_args_provider is not None:
        extra_args_provider(p)
    return p


def parse_args(argv: Optional[List[str]] = None, extra_args_provider: Optional[Callable] = None):
    return build_parser(extra_args_provider).parse_args(argv)


def _training_length(args: argparse.Namespace, global_batch: int):
    """(train_iters, train_samples or None) from exactly one of the three length flags."""
    given = [f for f, v in (("--train-iters", args.train_iters), ("--train-samples", args.train_samples),
                            ("--train-tokens", args.train_tokens)) if v is not None]
    if args.skip_train and not given:  # nothing is trained: the length only sizes the LR schedule
        return 1, None
    if len(given) != 1:
        raise ValueError("give exactly one of --train-iters, --train-samples, --train-tokens"
                         + (f" (got {', '.join(given)})" if given else ""))
    if args.train_iters is not None:
        if args.train_iters < 1:
            raise ValueError("--train-iters must be >= 1")
        return args.train_iters, None
    if args.train_tokens is not None:
        samples, flag = args.train_tokens // args.seq_length, f"--train-tokens {args.train_tokens}"
    else:
        samples, flag = args.train_samples, f"--train-samples {args.train_samples}"
    if samples < global_batch:
        raise ValueError(f"{flag} is less than one global batch ({global_batch} samples of {args.seq_length} tokens)")
    return samples // global_batch, samples


def _check_fault_tolerance(ft: FaultToleranceOptions, args: argparse.Namespace, lsgd: LsgdConfig,
                           simulation: SimulationOptions, checkpoint: CheckpointConfig, dims: ParallelDims) -> None:
    """--lsgd-fault-tolerance against the rest of the run; under it a site is the unit that
    fails, so it saves and loads checkpoints of its own: <dir>/site<k> under --save/--load."""
    refused = [(flag, why) for flag, why, given in (
        ("--lsgd-warmup-iters", "a synchronous warm-up averages gradients across sites every step, outside any "
                                "quorum", lsgd.rounds.warmup_iters > 0),
        ("--simulate-clock", "the simulated clock models a fixed set of sites", simulation.active)) if given]
    if ft.enabled and catalog.synchronizer_class(lsgd.algorithm).supports_fault_tolerance:  # its own refusals
        refused += catalog.synchronizer_class(lsgd.algorithm).refused_with_fault_tolerance(lsgd)
    ft.validate(algorithm=lsgd.algorithm, num_sites=dims.sites, refused=refused, need_site=True)
    if ft.enabled:
        site_dir = f"site{ft.site}"
        checkpoint.save = os.path.join(checkpoint.save, site_dir) if checkpoint.save else checkpoint.save
        checkpoint.load = os.path.join(checkpoint.load, site_dir) if checkpoint.load else checkpoint.load


def _site_sizes(text: Optional[str], flag: str = "--site-data-parallel-sizes") -> Optional[List[int]]:
    """--site-data-parallel-sizes "4,2" -> [4, 2] (None when not given); likewise the other per-site sizes."""
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: give one whole number per site, comma-separated (e.g. 4,2)") from None


def _layouts_given(dims: ParallelDims) -> str:
    return (f"--site-tensor-model-parallel-sizes {','.join(map(str, dims.site_tp))} / "
            f"--site-pipeline-model-parallel-sizes {','.join(map(str, dims.site_pp))}")


def _validate_model_per_site(model: TransformerConfig, dims: ParallelDims) -> None:
    """The model splits into every site's TP x PP (heads, layers, ...)."""
    if not dims.mixed_layouts:
        model.validate(dims.tp, dims.pp)
        return
    for site in range(dims.sites):
        try:
            model.validate(dims.tp_of(site), dims.pp_of(site))
        except ValueError as e:
            raise ValueError(f"{_layouts_given(dims)}: site {site}'s layout TP {dims.tp_of(site)} x PP "
                             f"{dims.pp_of(site)} cannot split the model: {e}") from None


def _refuse_for_site_shapes(given: str, shape: str, supported: str, algorithm: str, why: Optional[str],
                            combinations) -> None:
    """One error line for what sites of different shapes (`shape`: "sizes", "layouts") cannot
    run: the algorithm (`why` it refuses, None: it supports them), then each (flag, reason, used)."""
    if why is not None:
        raise ValueError(f"{given} (sites of different {shape}) is supported by --lsgd-algorithm {supported} only; "
                         f"{algorithm}: {why}")
    for flag, reason, used in combinations:
        if used:
            raise ValueError(f"{given} (sites of different {shape}) cannot be combined with {flag}: {reason}")


def _supporting(refusal: str) -> str:
    """The algorithms whose `refusal` attribute is None (they support that shape of sites)."""
    refused = catalog.refusals(refusal)
    return ", ".join(n for n in catalog.registered_algorithms() if n not in refused)


def _check_site_layouts(dims: ParallelDims, lsgd: LsgdConfig, simulation: SimulationOptions) -> None:
    """Sites of different TP x PP: only what exchanges in the canonical form runs
    (docs/heterogeneous_sites.md)."""
    if not dims.mixed_layouts:
        return
    _refuse_for_site_shapes(_layouts_given(dims), "layouts", _supporting("mixed_layouts_refusal"), lsgd.algorithm,
                            catalog.synchronizer_class(lsgd.algorithm).mixed_layouts_refusal, (
        ("--lsgd-compression", "compressed means are exchanged per rank, not in the layout-free form",
         lsgd.compression.enabled),
        ("--simulate-clock/--simulate-scenario", "the simulated clock models sites of one layout", simulation.active)))


def _check_unequal_sites(dims: ParallelDims, lsgd: LsgdConfig) -> None:
    """Sites of different data-parallel sizes: what supports them (docs/heterogeneous_sites.md)."""
    if not dims.heterogeneous:
        return
    cls = catalog.synchronizer_class(lsgd.algorithm)
    kinds = cls.unequal_sites_compressions
    _refuse_for_site_shapes(f"--site-data-parallel-sizes {','.join(map(str, dims.site_dp))}", "sizes",
                            _supporting("unequal_sites_refusal"), lsgd.algorithm, cls.unequal_sites_refusal, (
        (f"--lsgd-compression {lsgd.compression.kind}",
         (f"--lsgd-algorithm {lsgd.algorithm} weights and cuts into lanes {', '.join(kinds)} only" if kinds else
          "its compressed means are not weighted by tokens, nor cut into lanes, yet"),
         lsgd.compression.enabled and lsgd.compression.kind not in kinds),))


def _check_scenario_sites(scenario, dims: ParallelDims) -> None:
    """The run's sites are the scenario's: their number, and their sizes where it gives them."""
    if scenario.sites != dims.sites:
        raise ValueError(f"--simulate-scenario {scenario.path}: it describes {scenario.sites} sites, "
                         f"but --num-sites is {dims.sites}")
    if scenario.replicas_per_site is not None and tuple(scenario.replicas_per_site) != dims.site_sizes:
        sizes = ",".join(map(str, scenario.replicas_per_site))
        raise ValueError(f"--simulate-scenario {scenario.path}: its sites have {sizes} data-parallel replicas "
                         f"(replicas_per_site), this run {','.join(map(str, dims.site_sizes))}: give "
                         f"--site-data-parallel-sizes {sizes}")


def build_config(args: argparse.Namespace, world_size: int) -> RunConfig:
    """Validate everything once; raise ValueError with a message naming the flag.
    `world_size`: the torch.distributed world's, i.e. one site's under fault tolerance."""
    fault_tolerance = FaultToleranceOptions.from_args(args)
    for flag in ("--site-data-parallel-sizes", "--site-tensor-model-parallel-sizes",
                 "--site-pipeline-model-parallel-sizes"):
        if fault_tolerance.enabled and getattr(args, flag[2:].replace("-", "_"), None) is not None:
            raise ValueError(f"{flag} cannot be combined with --lsgd-fault-tolerance: elastic sites, each its own "
                             f"job, have one size each for now")
    if fault_tolerance.enabled:  # each site is a world of its own
        world_size *= args.num_sites
    dims = ParallelDims.from_world(world_size, args.tensor_model_parallel_size,
                                   args.pipeline_model_parallel_size, args.num_sites,
                                   _site_sizes(getattr(args, "site_data_parallel_sizes", None)),
                                   *(_site_sizes(getattr(args, flag[2:].replace("-", "_"), None), flag) for flag in (
                                       "--site-tensor-model-parallel-sizes", "--site-pipeline-model-parallel-sizes")))
    normalize_megatron_args(args, dims)
    if args.bf16 and args.fp16:
        raise ValueError("--bf16 and --fp16 are mutually exclusive")
    if args.micro_batch_size < 1:
        raise ValueError("--micro-batch-size must be >= 1")
    if args.global_batch_size is not None and args.global_batch_size < 1:
        raise ValueError(f"--global-batch-size must be >= 1 (got {args.global_batch_size})")
    global_batch = args.global_batch_size or args.micro_batch_size * dims.dp
    per_step = args.micro_batch_size * dims.dp
    if global_batch % per_step:
        layout = f"the sum of --site-data-parallel-sizes {','.join(map(str, dims.site_dp))}" if dims.heterogeneous \
            else f"{dims.dp_intra} per site x {dims.sites} sites"
        raise ValueError(
            f"--global-batch-size {global_batch} is not divisible by --micro-batch-size {args.micro_batch_size} x "
            f"data-parallel size {dims.dp} (= {layout}) = {per_step}")
    train_iters, train_samples = _training_length(args, global_batch)
    if args.exit_duration_in_mins is not None and args.exit_duration_in_mins <= 0:
        raise ValueError(f"--exit-duration-in-mins must be > 0 (got {args.exit_duration_in_mins:g})")
    for flag, value in (("--log-interval", args.log_interval), ("--eval-interval", args.eval_interval)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1")
    if args.eval_iters < 0:
        raise ValueError("--eval-iters must be >= 0")
    if args.full_validation and args.mock_data:
        raise ValueError("--full-validation needs a validation split of --data-path: --mock-data has no end")
    if args.exit_interval is not None and args.exit_interval < 1:
        raise ValueError("--exit-interval must be >= 1")
    if args.group_query_attention and not args.num_query_groups:
        raise ValueError("--group-query-attention needs --num-query-groups")
    if args.num_query_groups and not args.group_query_attention:
        raise ValueError("--num-query-groups needs --group-query-attention")
    if args.ddp_bucket_size < 0:
        raise ValueError("--ddp-bucket-size must be >= 0 (0: one bucket)")
    if args.distributed_timeout_minutes < 1:
        raise ValueError("--distributed-timeout-minutes must be >= 1")

    training = TrainingConfig(
        micro_batch_size=args.micro_batch_size, global_batch_size=global_batch, train_iters=train_iters,
        train_samples=train_samples, exit_duration_in_mins=args.exit_duration_in_mins,
        eval_interval=args.eval_interval, eval_iters=args.eval_iters, full_validation=args.full_validation,
        skip_train=args.skip_train,
        log_interval=args.log_interval,
        exit_interval=args.exit_interval, seed=args.seed, bf16=args.bf16, fp16=args.fp16,
        compile=args.compile,
        tensorboard_dir=args.tensorboard_dir, json_log=args.json_log, distributed_backend=args.distributed_backend,
        inter_site_backend=args.inter_site_backend,
        distributed_timeout_minutes=args.distributed_timeout_minutes)
    model = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        kv_channels=args.kv_channels, seq_length=args.seq_length,
        max_position_embeddings=args.max_position_embeddings,
        padded_vocab_size=1,  # set from the tokenizer at start-up
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
        normalization=args.normalization, norm_epsilon=args.norm_epsilon, swiglu=args.swiglu,
        add_bias_linear=not args.disable_bias_linear,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std, sequence_parallel=args.sequence_parallel,
        params_dtype=training.params_dtype, recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers)
    _validate_model_per_site(model, dims)
    optimizer = OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        muon_momentum=args.muon_momentum, muon_ns_steps=args.muon_ns_steps,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
        lr_decay_style=args.lr_decay_style, lr_warmup_iters=args.lr_warmup_iters,
        lr_decay_iters=args.lr_decay_iters, loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale, min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis)
    optimizer.validate(train_iters)
    tokenizer_type = args.tokenizer_type or ("NullTokenizer" if args.mock_data else None)
    if tokenizer_type is None:
        raise ValueError("--tokenizer-type is required (NullTokenizer with --vocab-size for --mock-data)")
    tokenizer = TokenizerConfig(
        tokenizer_type=tokenizer_type, tokenizer_model=args.tokenizer_model, vocab_file=args.vocab_file,
        merge_file=args.merge_file, vocab_size=args.vocab_size,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
    tokenizer.validate()
    data = DataConfig(
        data_path=list(args.data_path or []), train_data_path=list(args.train_data_path or []),
        valid_data_path=list(args.valid_data_path or []), test_data_path=list(args.test_data_path or []),
        split=args.split, data_cache_path=args.data_cache_path,
        mock_data=args.mock_data, seq_length=args.seq_length, seed=args.seed, eod_mask_loss=args.eod_mask_loss,
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        num_workers=args.num_workers)
    data.validate(need_train_data=not args.skip_train)
    if args.skip_train and not (data.mock_data or data.valid_data_path or data.test_data_path or data.data_path):
        raise ValueError("--skip-train evaluates the validation and test sets: give --valid-data-path or "
                         "--test-data-path (or --data-path with --split)")
    if args.skip_train and args.eval_iters == 0:
        raise ValueError("--skip-train with --eval-iters 0 would evaluate nothing; give --eval-iters > 0")
    budget = "--train-tokens" if args.train_tokens is not None else "--train-samples" if train_samples else None
    schedule = "--rampup-batch-size" if getattr(args, "rampup_batch_size", None) is not None else \
        "--step-batch-size-schedule" if getattr(args, "step_batch_size_schedule", None) is not None else None
    lsgd = catalog.config_from_args(args, dims.sites, RunFacts(
        num_microbatches=global_batch // per_step, pipeline_stages=dims.pp, fp16=args.fp16,
        sample_budget_flag=budget, batch_schedule_flag=schedule,
        per_token_loss=bool(getattr(args, "calculate_per_token_loss", False)),
        tied_embeddings=not args.untie_embeddings_and_output_weights, num_layers=args.num_layers))
    checkpoint = CheckpointConfig(
        save=args.save, load=args.load, save_interval=args.save_interval, no_save_optim=args.no_save_optim,
        no_load_optim=args.no_load_optim, no_load_rng=args.no_load_rng, finetune=args.finetune,
        verify_checksums=not args.no_verify_checkpoint_checksums)
    if args.skip_train:  # evaluation reads the model only: a checkpoint of any DP layout or site count
        checkpoint.no_load_optim = checkpoint.no_load_rng = True
    checkpoint.validate()
    stragglers = StragglerConfig.from_args(args)
    stragglers.validate(world_size)
    simulation = SimulationOptions.from_args(args)
    simulation.validate()  # reads and checks the scenario file
    _check_fault_tolerance(fault_tolerance, args, lsgd, simulation, checkpoint, dims)
    _check_unequal_sites(dims, lsgd)
    _check_site_layouts(dims, lsgd, simulation)
    if simulation.scenario is not None:
        _check_scenario_sites(load_scenario(simulation.scenario), dims)
    ddp = DDPConfig(bucket_size=args.ddp_bucket_size, overlap_grad_reduce=args.overlap_grad_reduce,
                    use_distributed_optimizer=args.use_distributed_optimizer)
    run = RunConfig(model=model, dims=dims, ddp=ddp, optimizer=optimizer, training=training, data=data,
                    tokenizer=tokenizer, lsgd=lsgd, num_microbatches=global_batch // per_step, raw_args=args,
                    checkpoint=checkpoint, stragglers=stragglers, simulation=simulation,
                    fault_tolerance=fault_tolerance)
    apply_megatron_compat_args(args, run)
    startup_checks(args, run)
    return run
