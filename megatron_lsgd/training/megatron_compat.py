"""Megatron-LM flags beyond the core set in arguments.py, each with Megatron's meaning.

`add_megatron_compat_args` adds the argparse groups; `apply_megatron_compat_args` checks
them and writes them into the RunConfig built by `build_config` (one call at its end).
A flag that would change behaviour in a way this implementation cannot honour is parsed
and refused with a message, never ignored.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_lsgd.training.arguments import RunConfig


def add_megatron_compat_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("numerical safety")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false",
                   help="do not stop when the loss or the gradient norm is NaN/Inf (by default the run stops "
                        "with an error before applying such an update, and never saves a non-finite model)")
    g.add_argument("--check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_true", default=True, help="the default; see --no-check-for-nan-in-loss-and-grad")


def apply_megatron_compat_args(args: argparse.Namespace, run: "RunConfig") -> None:
    run.optimizer.check_for_nan_in_grad = args.check_for_nan_in_loss_and_grad
