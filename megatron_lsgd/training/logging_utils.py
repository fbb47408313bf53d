"""Megatron's log line, plus our cross-site fields, and tensorboard scalars."""

from __future__ import annotations

import datetime
from typing import Dict, Optional

import torch


def print_rank(msg: str, rank: int, only: Optional[int] = 0) -> None:
    if only is None or rank == only:
        print(msg, flush=True)


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
    """SummaryWriter on the logging rank only; a no-op elsewhere or without a directory."""

    def __init__(self, log_dir: Optional[str], enabled: bool):
        self.writer = None
        if log_dir and enabled:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            self.writer = SummaryWriter(log_dir=log_dir, max_queue=1000)

    def scalars(self, values: Dict[str, float], step: int) -> None:
        if self.writer is None:
            return
        for k, v in values.items():
            if v is not None:
                self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
