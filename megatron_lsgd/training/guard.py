"""What stands between a user's mistake and a traceback (or worse, silent damage).

- `STARTUP_ERRORS` / `RUN_ERRORS`: the exception types a user can cause (bad flags,
  missing or corrupt files, a diverged run, a full disk). pretrain() turns them into one
  `error: ...` line and exit code 2; anything else is a bug and keeps its traceback.
- `take_save_lock`: one run per --save directory (checkpointing/lock.py), taken at start-up,
  which also proves that --save is a writable directory before any training is spent.
- `check_finite_loss`: Megatron's --check-for-nan-in-loss-and-grad for the loss (the
  gradient norm is checked by the optimizer before it applies an update).
- `warn_once`: a warning printed once per process for choices that run but are probably
  not what was meant.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Dict, NoReturn, Optional

import torch
import torch.distributed as dist

from megatron_lsgd.core.datasets.indexed_dataset import IndexedDatasetError
from megatron_lsgd.core.lsgd.catalog import synchronizer_class
from megatron_lsgd.core.output_files import WriteError
from megatron_lsgd.core.optimizer.sharded_optimizer import NonFiniteError
from megatron_lsgd.training.checkpointing.errors import CheckpointError
from megatron_lsgd.training.checkpointing.lock import SaveLock

# While building the run: flags, tokenizer files, datasets, checkpoints to load.
STARTUP_ERRORS = (ValueError, OSError, CheckpointError)
# While training: saving (disk full, ...), --json-log on a full disk, divergence, a corrupt sample. ValueError and
# OSError are not caught here: raised mid-run they are more likely bugs than user input.
RUN_ERRORS = (CheckpointError, NonFiniteError, IndexedDatasetError, WriteError)

_REPORTED_KEY = "megatron_lsgd/error_reported"
_warned = set()


def first_to_report(every_rank_without_store: bool = False) -> bool:
    """True on the first rank of the job to fail (one message, not one per rank, and not
    lost when the failing rank is not rank 0): a rank that fails because a peer failed
    first stays silent, since the peer's line says why. Without a reachable store (rank 0,
    which holds it, is gone) rank 0 speaks, or every rank when rank 0 may be the lost one."""
    if not dist.is_initialized():
        return True
    try:
        store = dist.distributed_c10d._get_default_store()
        # torchrun's store outlives a restart (--max-restarts): one key per attempt, or a
        # restarted job's failure would find the last attempt's mark and say nothing.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return store.add(f"{_REPORTED_KEY}/attempt_{attempt}", 1) == 1
    except Exception:
        return every_rank_without_store or dist.get_rank() == 0


def exit_with_error(err: BaseException, prefix: str = "") -> NoReturn:
    """One `error: ...` line on stderr and exit code 2, no traceback."""
    if first_to_report():
        print(f"error: {prefix}{err}", file=sys.stderr, flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    raise SystemExit(2) from err


def is_out_of_memory(err: BaseException) -> bool:
    """A device or host allocation failed (torch's OutOfMemoryError, or the CPU allocator's
    RuntimeError)."""
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and "DefaultCPUAllocator" in str(err) and "allocate" in str(err))


def out_of_memory_message(err: BaseException, run) -> str:
    """What to lower, with this run's values, instead of the allocator's report."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    m, t, d = run.model, run.training, run.dims
    return (f"out of memory ({first[:200]}). Lower --micro-batch-size (now {t.micro_batch_size}) or --seq-length "
            f"(now {m.seq_length}), raise --tensor-model-parallel-size (now {d.tp}) or "
            f"--pipeline-model-parallel-size (now {d.pp}), or use --use-distributed-optimizer and --bf16 to shrink "
            f"the optimizer state and activations")


def warn_once(key: str, message: str, rank: int = 0) -> None:
    if rank == 0 and key not in _warned:
        _warned.add(key)
        print(f"warning: {message}", file=sys.stderr, flush=True)


def _parent_is_a_file(path: str) -> Optional[str]:
    parent = os.path.dirname(os.path.abspath(path))
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    return parent if parent and not os.path.isdir(parent) else None


def check_output_paths(args) -> None:
    """Paths the run writes to, checked before anything is built (read-only checks; --save
    is checked by take_save_lock, which has to create it anyway)."""
    for flag, path, want in (("--json-log", getattr(args, "json_log", None), "file"),
                             ("--tensorboard-dir", getattr(args, "tensorboard_dir", None), "dir"),
                             ("--data-cache-path", getattr(args, "data_cache_path", None), "dir")):
        if not path:
            continue
        if want == "file" and os.path.isdir(path):
            raise ValueError(f"{flag} {path} is a directory; give a file path (one JSON object per line is "
                             f"appended to it)")
        if want == "dir" and os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"{flag} {path} is a file; give a directory")
        blocked = _parent_is_a_file(path)
        if blocked:
            raise ValueError(f"{flag} {path} cannot be created: {blocked} is a file")


def _validation_weight(split: str) -> float:
    parts = [float(p) for p in split.replace("/", ",").split(",")]
    return parts[1] if len(parts) > 1 else 0.0


def startup_checks(args, run) -> None:
    """Called once by build_config: output paths and settings that would make the run
    meaningless (errors), then choices that run but are probably not what was meant (one
    warning each, on rank 0)."""
    check_output_paths(args)
    rank = dist.get_rank() if dist.is_initialized() else 0
    t, data = run.training, run.data
    sync_cls = synchronizer_class(run.lsgd.algorithm)
    warmup = run.lsgd.rounds.warmup_iters
    if warmup and t.train_iters is not None and warmup >= t.train_iters:
        raise ValueError(f"--lsgd-warmup-iters {warmup} covers the whole run ({t.train_iters} "
                         f"iterations): "
                         f"--lsgd-algorithm {sync_cls.name} would never run; shorten the warm-up, or use "
                         f"--lsgd-algorithm sync for synchronous training")
    if run.dims.sites == 1 and sync_cls.inert_with_one_site:
        warn_once("inert-with-one-site",
                  f"--lsgd-algorithm {sync_cls.name} with --num-sites 1 has nothing to synchronize across sites: this "
                  f"run is plain Megatron training (set --num-sites to the number of sites)", rank)
    if t.eval_iters > 0 and not data.mock_data and _validation_weight(data.split) == 0:
        warn_once("no-validation-split",
                  f"--split {data.split} gives the validation set no data, so evaluation (--eval-iters "
                  f"{t.eval_iters} every --eval-interval {t.eval_interval} iterations) is skipped; give the "
                  f"second --split weight a share or pass --eval-iters 0", rank)


def take_save_lock(save_dir: Optional[str]) -> Optional[SaveLock]:
    """Collective. Rank 0 locks --save (creating it if needed); every rank raises the same
    CheckpointError when it cannot (another run holds it, it is a file, not writable)."""
    if not save_dir:
        return None
    lock, error = None, None
    if dist.get_rank() == 0:
        lock = SaveLock(save_dir)
        try:
            lock.acquire()
        except CheckpointError as err:
            error, lock = str(err), None
    message = [error]
    dist.broadcast_object_list(message, src=0)
    if message[0] is not None:
        raise CheckpointError(message[0])
    return lock


def check_finite_loss(losses: Dict[str, object], fp16: bool) -> None:
    """Raise NonFiniteError on a NaN loss, or an Inf loss outside fp16 (where the loss
    scaler skips overflowing steps by design)."""
    for name, value in losses.items():
        v = float(value.item() if hasattr(value, "item") else value)
        if math.isnan(v) or (math.isinf(v) and not fp16):
            raise NonFiniteError(f"the {name} is {v}: training diverged (lower --lr or lengthen the warmup); "
                                 f"nothing non-finite is saved")
