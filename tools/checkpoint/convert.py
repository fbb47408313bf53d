"""Convert GPT checkpoints between layouts and formats (Megatron's plugin style).

    python tools/checkpoint/convert.py --model-type GPT --loader lsgd --saver lsgd \\
        --load-dir ckpt/tp2pp2 --save-dir ckpt/tp1 \\
        --target-tensor-parallel-size 1 --target-pipeline-parallel-size 1
    python tools/checkpoint/convert.py --model-type GPT --loader lsgd --saver hf --load-dir ckpt --save-dir hf_out
    python tools/checkpoint/convert.py --model-type GPT --loader hf --saver lsgd --load-dir hf_in --save-dir ckpt \\
        --target-tensor-parallel-size 2

A loader plugin (`loader_<name>.py` beside this file) builds a layout-free FullModel
(megatron_lsgd/training/checkpointing/full_model.py); a saver plugin writes it. Megatron
streams tensors through a queue between two processes; this tool holds the full model in
CPU memory once, which is simpler and fine up to a few tens of billions of parameters.
Model weights only: optimizer state is not resharded (resume with --no-load-optim
--no-load-rng). See docs/checkpointing.md.
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

PLUGINS = ("lsgd", "hf")


def _plugin(kind: str, name: str):
    return importlib.import_module(f"{kind}_{name}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-type", required=True, choices=["GPT"])
    p.add_argument("--loader", required=True, choices=PLUGINS, help="format of --load-dir")
    p.add_argument("--saver", required=True, choices=PLUGINS, help="format of --save-dir")
    p.add_argument("--load-dir", required=True)
    p.add_argument("--save-dir", required=True)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    # Two-stage parse, as in Megatron: the plugins add their own flags.
    known, _ = build_parser().parse_known_args(argv)
    parser = build_parser()
    loader, saver = _plugin("loader", known.loader), _plugin("saver", known.saver)
    loader.add_arguments(parser)
    saver.add_arguments(parser)
    args = parser.parse_args(argv)
    from megatron_lsgd.training.checkpointing.errors import CheckpointError

    try:
        model = loader.load_checkpoint(args)
        where = saver.save_checkpoint(model, args)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    n = sum(t.numel() for t in model.params.values())
    print(f"converted {args.loader}:{args.load_dir} -> {args.saver}:{where} ({n:,} parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
