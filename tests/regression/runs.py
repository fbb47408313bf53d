"""Regression fixtures for the algorithms whose numbers must never move by accident.

Every (layout, configuration) pair below is trained once, and what it produced is kept in
`fixtures.json`: the logged loss of every iteration (exact floats) and a SHA-256 of every
rank's final parameters. `test_fixtures.py` re-runs them and demands bit equality.

One spawn per layout runs all configurations back to back in the same ranks (each run
re-seeds everything and builds its own process groups), which keeps the cost to three
process start-ups.

Floating-point results differ in the last bits between CPU families and torch builds, and
the project's machines change from session to session, so the file keeps one record per
platform (`run_cache.platform_signature`) and a layout passes when its numbers equal, bit for bit, the
record of any one platform: a code change that moves the numbers matches none of them.

On a platform that has no record yet, the test fails and names it; record it from code
whose numbers you know did not move (the last commit that passed, say), in a commit of
its own:

    python -m tests.regression.record                # add or replace this platform's record

When a change is *meant* to move the numbers (say why in the commit), the other platforms'
records are stale: `python -m tests.regression.record --drop-others`.

A configuration added to CONFIGS is recorded on this platform only, after the others are
re-run and found equal to this platform's record bit for bit (`record` refuses otherwise);
the other platforms keep their records without it, and on them it is not checked until a
session there records it.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Dict, List

import torch
import torch.distributed as dist
from tests.unit_tests.harness import spawn

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures.json")

COMMON = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
          "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "8", "--lr", "5e-3",
          "--min-lr", "5e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--mock-data",
          "--vocab-size", "250", "--make-vocab-size-divisible-by", "32", "--log-interval", "1", "--eval-iters", "0",
          "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "11", "--num-sites", "2"]

# Two sites in every layout; 4 ranks each.
LAYOUTS: Dict[str, List[str]] = {
    "tp2": ["--tensor-model-parallel-size", "2"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "zero1-dp2": ["--use-distributed-optimizer", "--ddp-bucket-size", "5000"],
}

# The outer Nesterov 0.7 / 0.9 was the default when these were recorded (until 2026-11-26): now
# pinned, so they keep guarding the momentum's arithmetic; "diloco-default-outer" guards the new
# default (plain averaging), added later and so recorded on fewer platforms.
PAPER_OUTER = ["--lsgd-outer-lr", "0.7", "--lsgd-outer-momentum", "0.9"]

CONFIGS: Dict[str, List[str]] = {
    "sync": ["--lsgd-algorithm", "sync"],
    "diloco": ["--lsgd-algorithm", "diloco", "--lsgd-interval", "3"] + PAPER_OUTER,
    "dilocox-int4": ["--lsgd-algorithm", "dilocox", "--lsgd-interval", "2", "--lsgd-compression", "int4"] + PAPER_OUTER,
    # scale-with-rank keeps H deterministic (hide-comm measures time)
    "dilocox-lowrank-int4-adaptive": ["--lsgd-algorithm", "dilocox", "--lsgd-interval", "2",
                                      "--lsgd-compression", "lowrank-int4", "--lsgd-rank", "4", "--lsgd-adaptive",
                                      "--lsgd-adaptive-h-rule", "scale-with-rank", "--lsgd-adaptive-h-min", "1",
                                      "--lsgd-adaptive-h-max", "4"] + PAPER_OUTER,
    "dilocox-apply-step": ["--lsgd-algorithm", "dilocox", "--lsgd-interval", "3", "--lsgd-compression", "int8",
                           "--lsgd-dilocox-apply-step", "1", "--lsgd-warmup-iters", "1"] + PAPER_OUTER,
    "diloco-default-outer": ["--lsgd-algorithm", "diloco", "--lsgd-interval", "3"],
}

WORLD = 4


def param_digest(model) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.global_named_parameters(), key=lambda kv: kv[0]):
        h.update(name.encode())
        h.update(p.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def _worker(rank: int, layout: str, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import pretrain_gpt

    record = {}
    for name, flags in CONFIGS.items():
        result = pretrain_gpt.main(COMMON + LAYOUTS[layout] + flags)
        record[name] = {"losses": result.logged_losses, "digest": param_digest(result.model)}
        dist.barrier()
    torch.save(record, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def run_layout(layout: str) -> Dict[str, dict]:
    """{config: {"losses": [...] (logging rank), "param_sha256": [one per rank]}}"""
    from megatron_lsgd.training.initialize import free_port

    with tempfile.TemporaryDirectory() as d:
        spawn(_worker, args=(layout, free_port(), d), nprocs=WORLD)
        records = [torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]
    return {name: {"losses": records[-1][name]["losses"], "param_sha256": [r[name]["digest"] for r in records]}
            for name in CONFIGS}
