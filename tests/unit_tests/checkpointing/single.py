"""Run pretrain_gpt.main in this process as a world of one (fast: no process start-up)."""

from __future__ import annotations

from typing import List

import torch.distributed as dist

from tests.unit_tests.checkpointing.launch import TINY
from tests.unit_tests.harness import free_port

LLAMA = ["--group-query-attention", "--num-query-groups", "2", "--normalization", "RMSNorm",
         "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights"]


def run_single(argv: List[str], monkeypatch, base: List[str] = TINY) -> int:
    """Exit code of pretrain_gpt.main(base + argv): 0, or 2 for a reported error."""
    import pretrain_gpt

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    try:
        pretrain_gpt.main(base + ["--distributed-backend", "gloo"] + argv)
        return 0
    except SystemExit as exc:
        return int(exc.code)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
