"""Process start-up: torch.distributed, device, process groups, seeds."""

from __future__ import annotations

import os
import random
import re
import socket
import sys
from datetime import timedelta
from typing import NoReturn

import numpy as np
import torch
import torch.distributed as dist

from megatron_lsgd.core.lsgd.catalog import synchronizer_class
from megatron_lsgd.core.lsgd.devices import choose_inter_site_backend
from megatron_lsgd.core.parallel_state import ProcessGroups, build_process_groups
from megatron_lsgd.core.tensor_parallel.random import MODEL_PARALLEL_RNG, RNGStatesTracker, model_parallel_seeds
from megatron_lsgd.training.arguments import RunConfig


def free_port() -> int:
    """A TCP port free on loopback now (for single-machine launches and tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(backend: str | None, timeout_minutes: float, device_type: str | None = None) -> torch.device:
    """Join the job started by torchrun (or run alone when launched with plain python); a
    failed join (port taken, ranks that never come) raises ValueError saying which.
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
        launched_by_env = "TORCHELASTIC_RUN_ID" not in os.environ and int(os.environ.get("WORLD_SIZE", 1)) > 1
        if launched_by_env and os.environ.get("RANK") == "0":  # possibly stale variables: say what is awaited
            print(f"note: joining a job of WORLD_SIZE={os.environ['WORLD_SIZE']} as RANK=0 from environment "
                  f"variables (not torchrun); waiting up to {timeout_minutes:g} min for the other ranks",
                  file=sys.stderr, flush=True)
        try:
            dist.init_process_group(backend, timeout=timedelta(minutes=timeout_minutes))
        except dist.DistError as err:
            raise ValueError(rendezvous_failure(err, timeout_minutes, launched_by_env)) from None
    return device


def rendezvous_failure(err: Exception, timeout_minutes: float, launched_by_env: bool) -> str:
    """What a failed join means in the launch's own terms (the environment it came from)."""
    env = os.environ
    where = f"MASTER_ADDR={env.get('MASTER_ADDR')} MASTER_PORT={env.get('MASTER_PORT')}"
    text = str(err)
    stale = (" RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the environment, not from torchrun: if they "
             "are left over from an earlier session, unset them to run a single process.") if launched_by_env else ""
    if "EADDRINUSE" in text or "address already in use" in text:
        return (f"{where}: the port is already in use (another job, or an earlier run still alive); choose a free "
                f"port (torchrun --master-port)")
    joined = re.search(r"(\d+)/(\d+) clients joined", text)
    if joined:
        return (f"only {joined.group(1)} of WORLD_SIZE={joined.group(2)} ranks joined at {where} within "
                f"{timeout_minutes:g} min (--distributed-timeout-minutes): the other ranks never started.{stale}")
    if "timed out" in text.lower() or "connect" in text.lower():
        return (f"RANK={env.get('RANK')} could not reach rank 0 at {where} within {timeout_minutes:g} min "
                f"(--distributed-timeout-minutes): rank 0 is not running or the address is wrong.{stale}")
    return f"joining the job at {where} failed: {text.strip().splitlines()[0] if text.strip() else type(err).__name__}"


def shutdown_distributed() -> None:
    """End of a launched run: wait for every rank, then tear the process groups down, so no
    rank exits (and kills gloo's worker threads) while a peer still talks to it."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def exit_finished_run() -> NoReturn:
    """Exit 0 now, skipping the interpreter's teardown: the run has written and closed
    everything and shut the groups down, but destroying gloo's remaining objects at exit can
    still abort ("terminate called without an active exception", SIGABRT: a finished
    1400-step benchmark rank on 2026-11-28, a finished pretrain_gpt.py site under torchrun on
    2026-11-29, after its `done` line). Under torchrun such an abort fails a finished run,
    and with --max-restarts starts it again."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def initialize(config: RunConfig, device: torch.device) -> tuple[ProcessGroups, RNGStatesTracker]:
    timeout = timedelta(minutes=config.training.distributed_timeout_minutes)
    algorithm = config.lsgd.algorithm
    inter_site_backend = choose_inter_site_backend(config.training.inter_site_backend, device, algorithm,
                                                   synchronizer_class(algorithm).communicates_from_a_thread)
    ft = config.fault_tolerance
    pgs = build_process_groups(config.dims, timeout=timeout, inter_site_backend=inter_site_backend,
                               only_site=ft.site if ft.enabled else None)  # elastic sites: a world each
    default_seed, tp_seed = model_parallel_seeds(config.training.seed, pgs.tp_rank, pgs.pp_rank)
    random.seed(default_seed)
    np.random.seed(default_seed)
    torch.manual_seed(default_seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(default_seed)
    tracker = RNGStatesTracker(device)
    tracker.add(MODEL_PARALLEL_RNG, tp_seed)
    return pgs, tracker
