"""Megatron-LM flags beyond the core set in arguments.py, each with Megatron's meaning.

Three calls from arguments.py: `add_megatron_compat_args` (the argparse groups),
`normalize_megatron_args` (early in build_config: what changes the flags the core set
reads) and `apply_megatron_compat_args` (at its end: checks, and the typed values written
into the RunConfig). A flag that would change behaviour in a way this implementation
cannot honour is parsed and refused with a message; one that changes only speed here is
accepted with a note. Nothing is ignored silently. See docs/megatron_compat.md.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import List, Optional

from megatron_lsgd.core.options import finite_float
from megatron_lsgd.training.batch_schedule import BatchSchedule

ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
CKPT_FORMATS = ("torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor")


@dataclass
class CompatConfig:
    """Run-time behaviour of the compatibility flags (read by training/compat_runtime.py)."""

    log_throughput: bool = False
    manual_gc: bool = False
    manual_gc_interval: int = 0
    manual_gc_eval: bool = True
    empty_unused_memory_level: int = 0
    profile: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: List[int] = field(default_factory=lambda: [0])
    profile_dir: Optional[str] = None
    batch_schedule: Optional[BatchSchedule] = None  # --rampup-batch-size / --step-batch-size-schedule
    notes: List[str] = field(default_factory=list)  # accepted flags without effect here, said once


def add_megatron_compat_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("numerical safety")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false",
                   help="do not stop when the loss or the gradient norm is NaN/Inf (by default the run stops "
                        "with an error before applying such an update, and never saves a non-finite model)")
    g.add_argument("--check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_true", default=True, help="the default; see --no-check-for-nan-in-loss-and-grad")

    g = p.add_argument_group("Megatron schedules (sample-based learning rate, batch-size ramp-up)")
    g.add_argument("--lr-decay-samples", type=int, default=None,
                   help="decay the learning rate over this many samples (the schedule then counts samples; "
                        "default with a --train-samples/--train-tokens budget: the budget)")
    g.add_argument("--lr-warmup-samples", type=int, default=0,
                   help="linear warmup over this many samples (the schedule then counts samples)")
    g.add_argument("--lr-warmup-fraction", type=finite_float, default=None,
                   help="warmup as a fraction of the decay span (instead of --lr-warmup-iters/-samples)")
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None, metavar=("START", "INCREMENT", "SAMPLES"),
                   help="start at START sequences per global batch and grow by INCREMENT in equal steps over the "
                        "first SAMPLES samples up to --global-batch-size")
    g.add_argument("--step-batch-size-schedule", type=str, default=None,
                   help='"THRESHOLD:BATCH ..." global batch size from each threshold on; thresholds count tokens '
                        "(K/M/B/T suffixes allowed) and the first must be 0; the last batch is the global batch size")
    g.add_argument("--decoupled-lr", type=finite_float, default=None,
                   help="separate peak learning rate for the input embedding and the output layer")
    g.add_argument("--decoupled-min-lr", type=finite_float, default=None,
                   help="separate minimum learning rate for the input embedding and the output layer")

    g = p.add_argument_group("Megatron model and kernel options")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="norm weights stored centred on zero: the layer multiplies by (1 + weight)")
    g.add_argument("--rotary-percent", type=finite_float, default=1.0,
                   help="fraction of each head's channels that rotary embeddings rotate (the rest pass through)")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="scaled_dot_product_attention kernels: flash = flash attention, fused = cuDNN / memory-"
                        "efficient, unfused and local = the math kernel, auto = PyTorch's choice")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="normalize the loss by the number of loss tokens of the whole global batch (of each site) "
                        "instead of averaging per-micro-batch means")
    g.add_argument("--use-mcore-models", action="store_true", help="accepted: the model is Megatron-Core style")
    g.add_argument("--use-legacy-models", action="store_true", help="refused: there is no legacy model here")
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default="local",
                   help="local PyTorch layers; transformer_engine is accepted and runs the same local layers")
    g.add_argument("--context-parallel-size", type=int, default=1, help="only 1: context parallelism does not exist")
    g.add_argument("--fp8-format", choices=["e4m3", "hybrid"], default=None,
                   help="refused: fp8 needs Transformer Engine, which this implementation does not use")
    g.add_argument("--fp8-margin", type=int, default=0, help="fp8 only (see --fp8-format)")
    g.add_argument("--fp8-amax-history-len", type=int, default=1, help="fp8 only (see --fp8-format)")
    g.add_argument("--fp8-amax-compute-algo", choices=["most_recent", "max"], default="most_recent",
                   help="fp8 only (see --fp8-format)")
    g.add_argument("--fp8-param-gather", action="store_true", help="fp8 only (see --fp8-format)")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="accepted: a kernel fusion; the vocab-parallel cross entropy here gives the same loss")

    g = p.add_argument_group("Megatron run-time options")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="accepted with --use-distributed-optimizer, with a note: the ZeRO-1 all-gather runs right "
                        "after the optimizer step here, not overlapped with the next forward (same results; "
                        "docs/megatron_compat.md says why)")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="refused: gradients are accumulated and reduced in fp32 here")
    g.add_argument("--ckpt-format", choices=CKPT_FORMATS, default="torch",
                   help="torch: Megatron's directory layout with per-rank torch files (docs/checkpointing.md); "
                        "other formats are refused when --save or --load is given")
    g.add_argument("--no-mmap-bin-files", dest="mmap_bin_files", action="store_false",
                   help="read each .bin file into memory instead of memory-mapping it")
    g.add_argument("--no-create-attention-mask-in-dataloader", dest="create_attention_mask_in_dataloader",
                   action="store_false",
                   help="accepted: the data loader builds an attention mask only for --reset-attention-mask")
    g.add_argument("--log-throughput", action="store_true",
                   help="add the model FLOP/s per rank (TFLOP/s/GPU) to the log line")
    g.add_argument("--manual-gc", action="store_true",
                   help="disable Python's automatic garbage collector; collect every --manual-gc-interval steps")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="with --manual-gc: steps between collections (0: only at start-up and around evaluation)")
    g.add_argument("--no-manual-gc-eval", dest="manual_gc_eval", action="store_false",
                   help="with --manual-gc: do not collect before and after evaluation")
    g.add_argument("--empty-unused-memory-level", type=int, choices=[0, 1, 2], default=0,
                   help="release cached CUDA memory: 1 after forward/backward, 2 also after the optimizer step "
                        "(nothing to release on CPU)")
    g.add_argument("--profile", action="store_true",
                   help="record a torch profiler trace of steps [--profile-step-start, --profile-step-end) into "
                        "--tensorboard-dir")
    g.add_argument("--profile-step-start", type=int, default=10, help="first profiled step (counted from 0)")
    g.add_argument("--profile-step-end", type=int, default=12, help="first step no longer profiled")
    g.add_argument("--profile-ranks", nargs="+", type=int, default=[0], help="global ranks that record a trace")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="accepted: --profile always uses the torch profiler here")
    g.add_argument("--tiktoken-pattern", choices=["v1", "v2"], default=None,
                   help="pre-tokenization pattern of --tokenizer-type TikTokenizer (default v2)")
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                   help="TikTokenizer: ids reserved for special tokens before the vocabulary")
    g.add_argument("--tokenizer-special-tokens", nargs="+", default=None,
                   help="TikTokenizer: the special tokens (must include <unk> <s> </s> <mask> <pad> <cls> <sep>)")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def normalize_megatron_args(args: argparse.Namespace, dims) -> None:
    """Early: adjust the core flags the way Megatron does before anything reads them."""
    if args.tokenizer_type is None and args.vocab_file and args.merge_file and not args.mock_data:
        args.tokenizer_type = "GPT2BPETokenizer"  # what a vocab + merges pair can only mean
    if args.sequence_parallel and dims.tp == 1:  # Megatron turns it off rather than failing
        args.sequence_parallel = False
        if _rank() == 0:
            print("warning: --sequence-parallel has no effect with --tensor-model-parallel-size 1 and is turned off "
                  "(as Megatron does)", file=sys.stderr, flush=True)
    if args.step_batch_size_schedule is not None:
        final = BatchSchedule.parse_steps(args.step_batch_size_schedule, args.seq_length)[-1][1]
        if args.global_batch_size is not None and args.global_batch_size != final:
            raise ValueError(f"--global-batch-size {args.global_batch_size} differs from the last batch size of "
                             f"--step-batch-size-schedule ({final}); give one or make them agree")
        args.global_batch_size = final


def _refusals(args: argparse.Namespace) -> None:
    if args.fp8_format is not None:
        raise ValueError(f"--fp8-format {args.fp8_format}: fp8 training needs NVIDIA Transformer Engine, which this "
                         f"implementation does not use; drop --fp8-format (and the other --fp8-* flags) and train "
                         f"in --bf16")
    if args.context_parallel_size != 1:
        raise ValueError(f"--context-parallel-size {args.context_parallel_size}: context parallelism is not "
                         f"implemented; use 1 (split long sequences with --tensor-model-parallel-size and "
                         f"--sequence-parallel instead)")
    if args.use_legacy_models:
        raise ValueError("--use-legacy-models: there is only the Megatron-Core style model here; drop the flag")
    if args.grad_reduce_in_bf16:
        raise ValueError("--grad-reduce-in-bf16: gradients are accumulated and reduced in fp32 here (the "
                         "cross-site synchronizers rely on it); drop the flag")
    if args.ckpt_format != "torch" and (args.save or args.load):
        raise ValueError(f"--ckpt-format {args.ckpt_format}: checkpoints are written in one format here, "
                         f"Megatron's directory layout with per-rank torch files (docs/checkpointing.md), and "
                         f"resharded offline by tools/checkpoint/convert.py; use --ckpt-format torch")
    if not args.create_attention_mask_in_dataloader and args.reset_attention_mask:
        raise ValueError("--reset-attention-mask needs the attention mask that "
                         "--no-create-attention-mask-in-dataloader turns off; drop one of them")


def _notes(args: argparse.Namespace) -> List[str]:
    notes = []
    if args.use_mcore_models:
        notes.append("--use-mcore-models (the model is Megatron-Core style)")
    if args.transformer_impl == "transformer_engine":
        notes.append("--transformer-impl transformer_engine (the local PyTorch layers run; same model)")
    if args.cross_entropy_loss_fusion:
        notes.append("--cross-entropy-loss-fusion (a kernel fusion; same loss)")
    if args.overlap_param_gather:
        notes.append("--overlap-param-gather (not overlapped here: the ZeRO-1 all-gather runs right after the "
                     "optimizer step; same results, slower on GPUs only)")
    if args.use_pytorch_profiler:
        notes.append("--use-pytorch-profiler (--profile always uses the torch profiler)")
    fp8_tuning = [f for f, on in (("--fp8-margin", args.fp8_margin != 0),
                                  ("--fp8-amax-history-len", args.fp8_amax_history_len != 1),
                                  ("--fp8-amax-compute-algo", args.fp8_amax_compute_algo != "most_recent"),
                                  ("--fp8-param-gather", args.fp8_param_gather)) if on]
    if fp8_tuning:
        notes.append(f"{', '.join(fp8_tuning)} (fp8 settings without --fp8-format, as in Megatron)")
    if args.tiktoken_pattern is not None and args.tokenizer_type != "TikTokenizer":
        notes.append(f"--tiktoken-pattern {args.tiktoken_pattern} (used by --tokenizer-type TikTokenizer only)")
    return notes


def _lr_schedule(args: argparse.Namespace, run) -> None:  # run: arguments.RunConfig
    """Megatron's learning-rate units. The scheduler counts samples, as Megatron's does,
    when the budget is in samples, the batch size varies or a span is given in samples:
    each successful step then advances it by that step's global batch, and spans given in
    iterations count (final) global batches. Otherwise it counts iterations; the two agree
    where both apply."""
    t, opt = run.training, run.optimizer
    for kind, iters, samples in (("warmup", args.lr_warmup_iters or None, args.lr_warmup_samples or None),
                                 ("decay", args.lr_decay_iters, args.lr_decay_samples)):
        if iters is not None and samples is not None:
            raise ValueError(f"give one of --lr-{kind}-iters and --lr-{kind}-samples")
    if args.lr_warmup_fraction is not None:
        if not 0 <= args.lr_warmup_fraction <= 1:
            raise ValueError(f"--lr-warmup-fraction {args.lr_warmup_fraction} must be in [0, 1]")
        if args.lr_warmup_iters or args.lr_warmup_samples:
            raise ValueError("give one of --lr-warmup-fraction, --lr-warmup-iters, --lr-warmup-samples")
    for flag, value in (("--lr-decay-samples", args.lr_decay_samples), ("--lr-warmup-samples", args.lr_warmup_samples)):
        if value is not None and value < 0:
            raise ValueError(f"{flag} must be >= 0")

    by_budget = t.train_samples is not None
    if by_budget or run.compat.batch_schedule is not None or args.lr_decay_samples is not None \
            or args.lr_warmup_samples:
        gbs = t.global_batch_size
        opt.lr_unit = "samples"
        if args.lr_decay_samples is not None:
            decay = args.lr_decay_samples
        elif args.lr_decay_iters is not None:
            decay = args.lr_decay_iters * gbs
        else:
            decay = t.train_samples if by_budget else t.train_iters * gbs
        opt.lr_decay_iters = decay
        opt.lr_warmup_iters = args.lr_warmup_samples or args.lr_warmup_iters * gbs
    if args.lr_warmup_fraction is not None:
        opt.lr_warmup_iters = args.lr_warmup_fraction * opt.lr_decay_iters
    if opt.lr_decay_iters < opt.lr_warmup_iters:
        unit = "samples" if opt.lr_unit == "samples" else "iterations"
        raise ValueError(f"the decay span ({opt.lr_decay_iters} {unit}) is shorter than the warmup "
                         f"({opt.lr_warmup_iters} {unit})")


def apply_megatron_compat_args(args: argparse.Namespace, run) -> None:  # run: arguments.RunConfig
    """Late: check the compatibility flags and write them into the typed config."""
    _refusals(args)
    run.optimizer.check_for_nan_in_grad = args.check_for_nan_in_loss_and_grad
    compat = CompatConfig(
        log_throughput=args.log_throughput, manual_gc=args.manual_gc, manual_gc_interval=args.manual_gc_interval,
        manual_gc_eval=args.manual_gc_eval, empty_unused_memory_level=args.empty_unused_memory_level,
        profile=args.profile, profile_step_start=args.profile_step_start, profile_step_end=args.profile_step_end,
        profile_ranks=list(args.profile_ranks), profile_dir=args.tensorboard_dir, notes=_notes(args))
    run.compat = compat
    if args.manual_gc_interval < 0:
        raise ValueError("--manual-gc-interval must be >= 0")
    if args.profile:
        if not 0 <= args.profile_step_start < args.profile_step_end:
            raise ValueError(f"--profile-step-start {args.profile_step_start} and --profile-step-end "
                             f"{args.profile_step_end}: need 0 <= start < end")
        if not args.tensorboard_dir:
            raise ValueError("--profile writes torch profiler traces into --tensorboard-dir (as Megatron's "
                             "--use-pytorch-profiler does): give --tensorboard-dir")
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise ValueError("--overlap-param-gather needs --use-distributed-optimizer (as in Megatron)")

    # Batch size schedule.
    if args.rampup_batch_size is not None and args.step_batch_size_schedule is not None:
        raise ValueError("give one of --rampup-batch-size and --step-batch-size-schedule")
    t = run.training
    per_step = t.micro_batch_size * run.dims.dp
    if args.rampup_batch_size is not None:
        start, increment, samples = args.rampup_batch_size
        compat.batch_schedule = BatchSchedule.rampup(start, increment, samples, t.global_batch_size, per_step)
    elif args.step_batch_size_schedule is not None:
        compat.batch_schedule = BatchSchedule(BatchSchedule.parse_steps(args.step_batch_size_schedule, args.seq_length),
                                              per_step, flag="--step-batch-size-schedule")
    if compat.batch_schedule is not None and t.train_samples is not None:
        t.train_iters = compat.batch_schedule.iterations_for(t.train_samples)
    _lr_schedule(args, run)

    # Decoupled learning rate for the embedding and output layer.
    opt = run.optimizer
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        raise ValueError("--decoupled-min-lr needs --decoupled-lr")
    if args.decoupled_lr is not None:
        opt.decoupled_lr = args.decoupled_lr
        opt.decoupled_min_lr = args.decoupled_min_lr if args.decoupled_min_lr is not None else opt.min_lr
        if not opt.decoupled_lr > 0 or not 0 <= opt.decoupled_min_lr <= opt.decoupled_lr:
            raise ValueError(f"--decoupled-lr {opt.decoupled_lr} must be > 0 and --decoupled-min-lr "
                             f"{opt.decoupled_min_lr} in [0, --decoupled-lr]")

    # Model.
    m = run.model
    m.apply_layernorm_1p = args.apply_layernorm_1p
    m.rotary_percent = args.rotary_percent
    m.attention_backend = args.attention_backend
    m.calculate_per_token_loss = args.calculate_per_token_loss
    m.validate(run.dims.tp, run.dims.pp)

    # Data and tokenizer.
    run.data.mmap_bin_files = args.mmap_bin_files
    tok = run.tokenizer
    tok.tiktoken_pattern = args.tiktoken_pattern or "v2"
    tok.tiktoken_num_special_tokens = args.tiktoken_num_special_tokens
    tok.special_tokens = args.tokenizer_special_tokens
    tok.validate()

    if compat.notes and _rank() == 0:
        print("note: accepted for Megatron compatibility, no effect here: " + "; ".join(compat.notes),
              file=sys.stderr, flush=True)
