"""Megatron-compatible command line -> typed, validated configuration.

`parse_args` only parses. `build_config` turns the namespace into dataclasses and checks
them once against the world size; every error names the flag to change.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Callable, ClassVar, List, Optional

import torch

from megatron_lsgd import cli
from megatron_lsgd.core.datasets.config import DataConfig
from megatron_lsgd.core.distributed.data_parallel import DDPConfig
from megatron_lsgd.core.lsgd import catalog
from megatron_lsgd.core.lsgd.config import LsgdConfig, RunFacts
from megatron_lsgd.core.lsgd.fault_tolerance.options import FaultToleranceOptions
from megatron_lsgd.core.options import OptionGroup, finite_float, option
from megatron_lsgd.core.optimizer.config import OptimizerConfig
from megatron_lsgd.core.parallel_state import ParallelDims
from megatron_lsgd.core.transformer.config import TransformerConfig
from megatron_lsgd.training.checkpointing.config import CheckpointConfig
from megatron_lsgd.training.guard import startup_checks
from megatron_lsgd.training.megatron_compat import (CompatConfig, add_megatron_compat_args,
                                                    apply_megatron_compat_args, normalize_megatron_args)
from megatron_lsgd.training.scenario import SimulationOptions, load_scenario
from megatron_lsgd.training.stragglers import SLOW_MODES, StragglerConfig
from megatron_lsgd.training.tokenizer.config import TokenizerConfig


@dataclass
class TrainingConfig(OptionGroup):
    """Each field with a flag declares it here once (the command line's training group); the
    batch and the length of the run are resolved from them in build_config."""

    title: ClassVar[str] = "training"

    micro_batch_size: int = option("--micro-batch-size", 1, type=int, required=True)
    global_batch_size: Optional[int] = option("--global-batch-size", None, type=int,
                                              help="default: micro batch size x data-parallel size")
    train_iters: Optional[int] = option("--train-iters", None, type=int,  # given, or derived from a budget
                                        help="inner steps to train (or give a budget: --train-samples / "
                                             "--train-tokens)")
    train_samples: Optional[int] = option("--train-samples", None, type=int,  # the job's (all sites), when given
                                          help="train on this many samples in total, all sites together (iterations "
                                               "= samples // global batch size)")
    train_tokens: Optional[int] = option("--train-tokens", None, type=int,
                                         help="train on this many tokens in total, all sites together (samples = "
                                              "tokens // --seq-length)")
    exit_duration_in_mins: Optional[float] = option(
        "--exit-duration-in-mins", None, type=float,
        help="stop (saving a checkpoint with --save) once this many minutes have passed since start-up; every rank "
             "stops at the same iteration and a resumed run continues exactly")
    eval_interval: int = option("--eval-interval", 1000)
    eval_iters: int = option("--eval-iters", 100, help="0 disables evaluation")
    full_validation: bool = option(  # every evaluation covers the whole validation split, the same samples
        "--full-validation", False,
        help="every evaluation runs over the whole validation split, the same samples each time, so the points of a "
             "validation curve (and runs with other seeds) are comparable; --eval-iters then only switches "
             "evaluation on (> 0) or off (0)")
    log_interval: int = option("--log-interval", 100)
    exit_interval: Optional[int] = option("--exit-interval", None, type=int)
    exit_signal_handler: bool = option(
        "--exit-signal-handler", False,
        help="on SIGTERM (a scheduler's notice before its time limit), save a checkpoint at the next iteration, on "
             "every rank together, and exit 0; without it SIGTERM stops the run at once")
    skip_train: bool = option("--skip-train", False,  # evaluate the held-out sets only
                              help="train nothing: evaluate the model (from --load) on the validation and test sets "
                                   "and exit; no --train-iters needed")
    seed: int = option("--seed", 1234)
    bf16: bool = option("--bf16", False)
    fp16: bool = option("--fp16", False)
    compile: bool = option(  # each transformer layer's forward compiled (core/transformer/compile.py)
        "--compile", False,
        help="compile each transformer layer's forward with torch.compile (regional: the layers share one graph, "
             "hooks stay at layer boundaries); after the second step, once, prints the first step's graphs and "
             "graph breaks and the second's breaks and recompilations (docs/performance.md)")
    tensorboard_dir: Optional[str] = option("--tensorboard-dir", None)
    json_log: Optional[str] = None  # --json-log (the benchmarking group): one JSON object per log interval
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
    group = TransformerConfig.add_arguments(p)
    # Megatron's switch for --num-query-groups; the groups themselves are the config's
    group.add_argument("--group-query-attention", action="store_true",
                       help="share key/value heads among groups of query heads (with --num-query-groups)")


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
    # each core config declares its own flags (option groups); parallelism, the benchmarking
    # switches and Megatron's extras are read where they are resolved
    for add in (_model_args, _parallel_args, DDPConfig.add_arguments, TrainingConfig.add_arguments,
                OptimizerConfig.add_arguments, DataConfig.add_arguments, TokenizerConfig.add_arguments,
                catalog.add_arguments, FaultToleranceOptions.add_arguments, CheckpointConfig.add_arguments,
                _emulation_args, SimulationOptions.add_arguments, add_megatron_compat_args):
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
    if ft.enabled and catalog.synchronizer_class(lsgd.algorithm).fault_tolerance_refusal is None:  # its own refusals
        refused += catalog.synchronizer_class(lsgd.algorithm).refused_with_fault_tolerance(lsgd)
    if ft.enabled and dims.heterogeneous:  # elastic sites of different sizes (fault_tolerance/lanes.py)
        sizes = f"--site-data-parallel-sizes {','.join(map(str, dims.site_dp))}"
        why = catalog.synchronizer_class(lsgd.algorithm).elastic_unequal_sites_refusal
        if why is not None and catalog.synchronizer_class(lsgd.algorithm).fault_tolerance_refusal is None:
            raise ValueError(f"{sizes} with --lsgd-fault-tolerance {ft.mode} is supported by --lsgd-algorithm "
                             f"{_supporting('elastic_unequal_sites_refusal')} only; {lsgd.algorithm}: {why}")
        refused += catalog.synchronizer_class(lsgd.algorithm).refused_with_elastic_unequal_sites(lsgd)
        refused += [(flag, why) for flag, why, given in (
            ("--use-distributed-optimizer", f"with {sizes} a healing rank assembles its state lane by lane from "
                                            "whole buckets, and ZeRO-1 shards are cut per site", args.use_distributed_optimizer),
            (f"--lsgd-compression {lsgd.compression.kind}", f"with {sizes} the elastic means are fp32 only",
             lsgd.compression.enabled)) if given]
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


def _elastic_world(site_world: int, args: argparse.Namespace, site_dp: Optional[List[int]], site: int) -> int:
    """The job's world under fault tolerance, from one site's (torchrun's): S equal sites, or
    with --site-data-parallel-sizes the sum of the sites' ranks, this site's being its own."""
    if not site_dp:
        return site_world * args.num_sites
    model = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if len(site_dp) == args.num_sites and 0 <= site < len(site_dp) and site_world != model * site_dp[site]:
        raise ValueError(f"--site-data-parallel-sizes {','.join(map(str, site_dp))}: site {site} (--lsgd-site) has "
                         f"{site_dp[site]} data-parallel ranks x TP x PP {model} = {model * site_dp[site]} ranks, "
                         f"but its torchrun world has {site_world}")
    return model * sum(site_dp)


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
    for flag in ("--site-tensor-model-parallel-sizes", "--site-pipeline-model-parallel-sizes"):
        if fault_tolerance.enabled and getattr(args, flag[2:].replace("-", "_"), None) is not None:
            raise ValueError(f"{flag} cannot be combined with --lsgd-fault-tolerance: a healing site would need "
                             f"the state of another layout, which torchft's heal (rank to rank) does not reshard")
    site_dp = _site_sizes(getattr(args, "site_data_parallel_sizes", None))
    if fault_tolerance.enabled:  # each site is a world of its own
        world_size = _elastic_world(world_size, args, site_dp, fault_tolerance.site)
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

    training = TrainingConfig.from_args(
        args, global_batch_size=global_batch, train_iters=train_iters, train_samples=train_samples,
        json_log=args.json_log, distributed_backend=args.distributed_backend,
        inter_site_backend=args.inter_site_backend, distributed_timeout_minutes=args.distributed_timeout_minutes)
    model = TransformerConfig.from_args(
        args, padded_vocab_size=1,  # set from the tokenizer at start-up
        sequence_parallel=args.sequence_parallel, params_dtype=training.params_dtype)
    _validate_model_per_site(model, dims)
    optimizer = OptimizerConfig.from_args(args)
    optimizer.validate(train_iters)
    tokenizer_type = args.tokenizer_type or ("NullTokenizer" if args.mock_data else None)
    if tokenizer_type is None:
        raise ValueError("--tokenizer-type is required (NullTokenizer with --vocab-size for --mock-data)")
    tokenizer = TokenizerConfig.from_args(args, tokenizer_type=tokenizer_type)
    tokenizer.validate()
    data = DataConfig.from_args(args, seq_length=args.seq_length, seed=args.seed)
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
    checkpoint = CheckpointConfig.from_args(args)
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
    ddp = DDPConfig.from_args(args)
    run = RunConfig(model=model, dims=dims, ddp=ddp, optimizer=optimizer, training=training, data=data,
                    tokenizer=tokenizer, lsgd=lsgd, num_microbatches=global_batch // per_step, raw_args=args,
                    checkpoint=checkpoint, stragglers=stragglers, simulation=simulation,
                    fault_tolerance=fault_tolerance)
    apply_megatron_compat_args(args, run)
    startup_checks(args, run)
    return run
