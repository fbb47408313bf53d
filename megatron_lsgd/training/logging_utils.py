"""Megatron's log line, plus our cross-site fields (and its losses averaged over sites), and
tensorboard scalars."""

from __future__ import annotations

import datetime
import threading
from contextlib import contextmanager
from typing import Dict, Iterator, Optional

import torch

from megatron_lsgd.core.output_files import os_error_in, write_error


def print_rank(msg: str, rank: int, only: Optional[int] = 0) -> None:
    if only is None or rank == only:
        print(msg, flush=True)


def mean_across_sites(values: Dict[str, torch.Tensor], membership, sites: int) -> Dict[str, float]:
    """The losses a log line or an evaluation reports, each averaged over sites (collective
    over the sites through the membership: every site calls it)."""
    if sites > 1 and values:
        stacked = torch.cat(list(values.values()))
        membership.mean_over_sites(stacked)  # a few bytes, at log intervals only
        values = dict(zip(values.keys(), stacked.split(1)))
    return {k: float(v.item()) for k, v in values.items()}


def training_log_line(iteration: int, train_iters: int, consumed_samples: int, elapsed_ms: float, lr: float,
                      global_batch: int, losses: Dict[str, float], loss_scale: float, grad_norm: Optional[float],
                      skipped: int, nans: int, extra: Dict[str, str]) -> str:
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    parts = [f" [{now}] iteration {iteration:8d}/{train_iters:8d}",
             f"consumed samples: {consumed_samples:12d}",
             f"elapsed time per iteration (ms): {elapsed_ms:.1f}",
             f"learning rate: {lr:.6E}",
             f"global batch size: {global_batch:5d}"]
    parts += [f"{k}: {v:.6E}" for k, v in losses.items()]
    parts.append(f"loss scale: {loss_scale:.1f}")
    if grad_norm is not None:
        parts.append(f"grad norm: {grad_norm:.3f}")
    parts += [f"number of skipped iterations: {skipped:3d}", f"number of nan iterations: {nans:3d}"]
    parts += [f"{k}: {v}" for k, v in extra.items()]
    return " | ".join(parts) + " |"


def peak_cuda_memory_mb(device: torch.device) -> Dict[str, float]:
    """This process's peak CUDA memory (allocated by tensors, reserved by the caching
    allocator) in MB; nothing off CUDA, where the peak RSS says it."""
    if device.type != "cuda":
        return {}
    return {"peak_cuda_allocated_mb": torch.cuda.max_memory_allocated(device) / 2**20,
            "peak_cuda_reserved_mb": torch.cuda.max_memory_reserved(device) / 2**20}


class TensorboardWriter:
    """SummaryWriter on the logging rank only; a no-op elsewhere or without a directory.
    The event file is a log, kept on a failure; a failed write (tensorboard's writer thread
    hands its OSError to the next call) is a WriteError naming --tensorboard-dir."""

    def __init__(self, log_dir: Optional[str], enabled: bool):
        self.writer = None
        self.log_dir = log_dir
        self._previous_hook = None
        if log_dir and enabled:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            self._previous_hook = threading.excepthook
            threading.excepthook = self._quiet_writer_thread
            with self._writing():
                self.writer = SummaryWriter(log_dir=log_dir, max_queue=1000)

    def _quiet_writer_thread(self, args) -> None:
        """tensorboard's writer thread re-raises its OSError after keeping it for the next
        call: that call reports it once, as a WriteError; the thread's own traceback would
        be a second, raw report."""
        if type(args.thread).__name__ == "_AsyncWriterThread" and os_error_in(args.exc_value) is not None:
            return
        self._previous_hook(args)

    def _restore_hook(self) -> None:
        if self._previous_hook is not None and threading.excepthook == self._quiet_writer_thread:
            threading.excepthook = self._previous_hook
        self._previous_hook = None

    @contextmanager
    def _writing(self) -> Iterator[None]:
        try:
            yield
        except Exception as err:
            found = os_error_in(err)
            if found is None:
                raise
            self.writer = None  # closing it would raise the same error again
            self._restore_hook()
            raise write_error(found, f"--tensorboard-dir {self.log_dir}") from None

    def scalars(self, values: Dict[str, float], step: int) -> None:
        if self.writer is None:
            return
        with self._writing():
            for k, v in values.items():
                if v is not None:
                    self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        if self.writer is not None:
            with self._writing():
                self.writer.flush()
                self.writer.close()
            self._restore_hook()
