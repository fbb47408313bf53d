"""Convert GPT checkpoints between layouts and formats (Megatron's plugin style).

    python tools/checkpoint/convert.py --model-type GPT --loader lsgd --saver lsgd \\
        --load-dir ckpt/tp2pp2 --save-dir ckpt/tp1 \\
        --target-tensor-parallel-size 1 --target-pipeline-parallel-size 1
    python tools/checkpoint/convert.py --model-type GPT --loader lsgd --saver hf --load-dir ckpt --save-dir hf_out
    python tools/checkpoint/convert.py --model-type GPT --loader hf --saver lsgd --load-dir hf_in --save-dir ckpt \\
        --target-tensor-parallel-size 2

A loader plugin (`loader_<name>.py` beside this file) describes a layout-free FullModel
(megatron_lsgd/training/checkpointing/full_model.py); a saver plugin writes it. The tool
streams: the loader reads only the source's structure (memory-mapped torch files,
safetensors headers), and the saver makes and writes one target file at a time (a TP x PP
slot's model or optimizer file of one site, or one Hugging Face shard, --max-shard-size),
reading from the source only the tensors that file needs and releasing them before the
next. Host memory is bounded by the largest target file plus the source pages it is made
from and one full tensor, not by the model (tools/benchmarks/parts/convert_memory.py measures it).

lsgd -> lsgd also reshards the optimizer state (Adam moments and step counts, the fp32
main weights of bf16/fp16 models, ZeRO-1 shards, Muon momentum, the loss scaler), the LR
schedule and data positions, and the synchronizer's per-parameter state (local-SGD
anchors and outer momentum), for every site (sites of different data-parallel sizes or
TP x PP layouts each read in their own): the result resumes with --no-load-rng at any DP_intra, with or without
--use-distributed-optimizer (RNG states are not converted). A
synchronizer state that cannot be mapped to parameters (error feedback, values in
flight) is refused naming the algorithm; --model-only converts the weights alone (resume
with --no-load-optim --no-load-rng). See docs/checkpointing.md.

The source is never written: --save-dir may not be --load-dir, lie inside it or contain it,
and must be empty or new unless --overwrite is given.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for path in (HERE, ROOT):
    if path not in sys.path:
        sys.path.insert(0, path)

from megatron_lsgd import cli  # noqa: E402

PLUGINS = ("lsgd", "hf")


def _plugin(kind: str, name: str):
    return importlib.import_module(f"{kind}_{name}")


EPILOG = ("lsgd -> lsgd converts every site's model with its optimizer state (ZeRO-1 shards, Adam moments, fp32 main "
          "weights, loss scale), the LR schedule, the data positions and the synchronizer's per-parameter state "
          "(local-SGD anchors, outer momentum), also of sites of different data-parallel sizes or layouts; resume "
          "the result with --no-load-rng at any data-parallel size. "
          "Synchronizer state that cannot be resharded is refused naming the algorithm. See docs/checkpointing.md.")


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=EPILOG, allow_abbrev=False,
                                formatter_class=cli.HelpFormatter)
    p.add_argument("--model-type", required=True, choices=["GPT"])
    p.add_argument("--loader", required=True, choices=PLUGINS, help="format of --load-dir")
    p.add_argument("--saver", required=True, choices=PLUGINS, help="format of --save-dir")
    p.add_argument("--load-dir", required=True)
    p.add_argument("--save-dir", required=True, help="a new or empty directory (see --overwrite)")
    p.add_argument("--model-only", action="store_true",
                   help="lsgd -> lsgd: convert the model weights alone (site 0's), without the optimizer, "
                        "synchronizer and schedule state (resume with --no-load-optim --no-load-rng); needed for "
                        "a source saved with --no-save-optim")
    p.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty --save-dir: an lsgd saver adds (or replaces) the iteration and "
                        "moves the tracker to it; the hf saver replaces the directory's contents")
    return p


def check_paths(load_dir: str, save_dir: str, overwrite: bool) -> None:
    """Refuse anything that could write over the source or over other data."""
    src, dst = os.path.realpath(load_dir), os.path.realpath(save_dir)
    if src == dst:
        raise ValueError(f"--save-dir {save_dir} is --load-dir: converting in place would overwrite the source; "
                         f"choose a new directory")
    if dst.startswith(src + os.sep):
        raise ValueError(f"--save-dir {save_dir} is inside --load-dir {load_dir}: writing there would change the "
                         f"source checkpoint; choose a directory outside it")
    if src.startswith(dst + os.sep):
        raise ValueError(f"--load-dir {load_dir} is inside --save-dir {save_dir}: writing the output would replace "
                         f"or delete the source; choose a directory outside it")
    if os.path.exists(save_dir) and not os.path.isdir(save_dir):
        raise ValueError(f"--save-dir {save_dir} is a file")
    if os.path.isdir(save_dir) and not overwrite:
        present = sorted(os.listdir(save_dir))
        if present:
            raise ValueError(f"--save-dir {save_dir} is not empty (it holds {', '.join(present[:4])}"
                             f"{', ...' if len(present) > 4 else ''}): choose a new or empty directory, or pass "
                             f"--overwrite to write into it")


DROPPED_STATE_NOTE = (
    "note: model weights only (--model-only). The source's optimizer state (Adam moments, fp32 main weights, loss "
    "scale), its synchronizer state (anchors, outer momentum, error feedback) and RNG states are not converted. "
    "Resume with --no-load-optim --no-load-rng: the iteration, consumed samples (data position) and the LR schedule "
    "continue; Adam restarts from zero moments with its bias correction, local-SGD rounds restart from the loaded "
    "weights, and dropout draws differ. A short re-warmup (--lr-warmup-iters) avoids a loss spike from the fresh "
    "moments.")
RESHARDED_NOTE = (
    "note: the optimizer state (Adam moments, step counts, fp32 main weights, loss scale), the LR schedule, the data "
    "positions and the synchronizer's per-parameter state were resharded for {sites} site(s); the checkpoint loads "
    "at any data-parallel size per site. RNG states are not converted: resume with --no-load-rng (dropout draws "
    "differ from an uninterrupted run).")


def check_flags(args) -> None:
    if args.model_only and not (args.loader == "lsgd" and args.saver == "lsgd"):
        raise ValueError("--model-only applies to --loader lsgd --saver lsgd only (a Hugging Face checkpoint holds "
                         "model weights alone)")


def main(argv: Optional[List[str]] = None) -> int:
    # Two-stage parse, as in Megatron: the plugins add their own flags.
    known, _ = build_parser().parse_known_args(argv)
    parser = build_parser()
    loader, saver = _plugin("loader", known.loader), _plugin("saver", known.saver)
    loader.add_arguments(parser)
    saver.add_arguments(parser)
    args = parser.parse_args(argv)
    from megatron_lsgd.training.checkpointing.errors import CheckpointError
    from megatron_lsgd.training.checkpointing.lazy_tensors import numel_of
    from megatron_lsgd.training.checkpointing.lock import SaveLock

    # What the lsgd loader reads: the optimizer state too when an lsgd checkpoint is the target.
    args.with_optimizer = args.loader == "lsgd" and args.saver == "lsgd" and not args.model_only
    lock = None
    try:
        check_flags(args)
        check_paths(args.load_dir, args.save_dir, args.overwrite)
        model = loader.load_checkpoint(args)
        if os.path.isdir(args.save_dir):  # a training run saving there holds this lock
            lock = SaveLock(args.save_dir, flag="--save-dir")
            lock.acquire()
        where = saver.save_checkpoint(model, args)
    except (CheckpointError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        if lock is not None:
            lock.release()
    n = numel_of(model.params)
    print(f"converted {args.loader}:{args.load_dir} -> {args.saver}:{where} ({n:,} parameters)")
    if getattr(model, "resume", None) is not None:
        print(RESHARDED_NOTE.format(sites=len(model.resume.sites)))
    elif args.saver == "lsgd" and getattr(model, "source_has_optimizer", False):
        print(DROPPED_STATE_NOTE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
