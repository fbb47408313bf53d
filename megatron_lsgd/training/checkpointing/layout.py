"""Megatron's directory layout and the tracker file.

    <dir>/latest_checkpointed_iteration.txt      iteration number (or "release")
    <dir>/iter_0000100/metadata.json             layout, model config, args, file sizes
    <dir>/iter_0000100/mp_rank_TT[_PPP]/model_site_SSS.pt        model of stage (TT, PPP), site SSS
    <dir>/iter_0000100/mp_rank_TT[_PPP]/rank_site_SSS_dp_DDD.pt  ZeRO shard, RNG, synchronizer state
    <dir>/iter_0000100/mp_rank_TT[_PPP]/optimizer_site_SSS.pt    converted: the same by parameter
    <dir>/.iter_0000100.partial/                 a save in progress (never read)

The `_PPP` suffix appears only with pipeline parallelism, as in Megatron.
"""

from __future__ import annotations

import os

from megatron_lsgd.training.checkpointing.errors import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"
RELEASE = "release"


def iteration_dir_name(iteration: int, release: bool = False) -> str:
    return RELEASE if release else f"iter_{iteration:07d}"


def partial_dir_name(iteration: int) -> str:
    return f".{iteration_dir_name(iteration)}.partial"


def mp_rank_dir_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def model_file_name(site: int) -> str:
    return f"model_site_{site:03d}.pt"


def rank_file_name(site: int, dp_intra: int) -> str:
    return f"rank_site_{site:03d}_dp_{dp_intra:03d}.pt"


def optimizer_file_name(site: int) -> str:
    """A converted checkpoint's optimizer/synchronizer state of stage (TT, PPP), site SSS, by
    parameter (any DP_intra loads it)."""
    return f"optimizer_site_{site:03d}.pt"


def read_tracker(load_dir: str) -> str:
    """The iteration directory the tracker names ('iter_XXXXXXX' or 'release')."""
    path = os.path.join(load_dir, TRACKER)
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"--load {load_dir}: no such directory")
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing: {load_dir} holds no completed checkpoint "
                              f"(a save that was interrupted never writes the tracker)")
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError as err:
        raise CheckpointError(f"cannot read the tracker {path}: {err}") from err
    if text == RELEASE:
        return RELEASE
    if not text.isdigit():
        raise CheckpointError(f"tracker {path} should hold an iteration number or 'release', found {text[:80]!r}")
    return iteration_dir_name(int(text))
