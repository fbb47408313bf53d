"""Process start-up: torch.distributed, device, process groups, seeds."""

from __future__ import annotations

import os
import random
import socket
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megatron_lsgd.core.lsgd.devices import choose_inter_site_backend
from megatron_lsgd.core.parallel_state import ProcessGroups, build_process_groups
from megatron_lsgd.core.tensor_parallel.random import MODEL_PARALLEL_RNG, RNGStatesTracker, model_parallel_seeds
from megatron_lsgd.training.arguments import RunConfig


def free_port() -> int:
    """A TCP port free on loopback now (for single-machine launches and tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(backend: str | None, timeout_minutes: int, device_type: str | None = None) -> torch.device:
    """Join the job started by torchrun (or run alone when launched with plain python).
    `device_type` (--device): None computes on CUDA when there is CUDA and the backend is
    not gloo; "cuda" with gloo shares the GPUs among the ranks (LOCAL_RANK modulo the GPU
    count), e.g. two one-rank sites on one GPU."""
    if "RANK" not in os.environ:  # plain `python pretrain_gpt.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda needs CUDA, which is not available here; use --device cpu")
    use_cuda = device_type == "cuda" or (device_type is None and torch.cuda.is_available() and backend != "gloo")
    backend = backend or ("nccl" if use_cuda else "gloo")
    if backend == "nccl" and not use_cuda:
        raise ValueError("--distributed-backend nccl needs CUDA; use gloo on CPU")
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local % torch.cuda.device_count()) if use_cuda else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(minutes=timeout_minutes))
    return device


def shutdown_distributed() -> None:
    """End of a launched run: wait for every rank, then tear the process groups down, so no
    rank exits (and kills gloo's worker threads) while a peer still talks to it."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def initialize(config: RunConfig, device: torch.device) -> tuple[ProcessGroups, RNGStatesTracker]:
    timeout = timedelta(minutes=config.training.distributed_timeout_minutes)
    inter_site_backend = choose_inter_site_backend(config.training.inter_site_backend, device)
    pgs = build_process_groups(config.dims, timeout=timeout, inter_site_backend=inter_site_backend)
    default_seed, tp_seed = model_parallel_seeds(config.training.seed, pgs.tp_rank, pgs.pp_rank)
    random.seed(default_seed)
    np.random.seed(default_seed)
    torch.manual_seed(default_seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(default_seed)
    tracker = RNGStatesTracker(device)
    tracker.add(MODEL_PARALLEL_RNG, tp_seed)
    return pgs, tracker
