"""Resharding: a TP2 x PP2 checkpoint -> TP1 x PP1 -> TP4 keeps the weights exactly and
gives the same logits on a fixed batch (the TP4 logits computed by 4 ranks)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megatron_lsgd.training.checkpointing.full_model import read_lsgd, to_module
from tests.unit_tests.checkpointing.launch import TINY
from tests.unit_tests.harness import free_port, merge_full_params, run_distributed, spawn

TOKENS = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5]])
TRAIN = TINY + ["--train-iters", "3", "--global-batch-size", "4", "--hidden-dropout", "0", "--attention-dropout", "0"]


def _convert(src: str, dst: str, tp: int, pp: int) -> None:
    from tools.checkpoint.convert import main

    assert main(["--model-type", "GPT", "--loader", "lsgd", "--saver", "lsgd", "--load-dir", src, "--save-dir", dst,
                 "--target-tensor-parallel-size", str(tp), "--target-pipeline-parallel-size", str(pp)]) == 0


def _logits_worker(rank: int, world: int, port: int, argv, out_path: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import pretrain_gpt
    from megatron_lsgd.training.arguments import build_config, parse_args
    from megatron_lsgd.training.initialize import init_distributed
    from megatron_lsgd.training.training import Trainer

    device = init_distributed("gloo", 5)
    config = build_config(parse_args(argv), world)
    trainer = Trainer(config, pretrain_gpt.model_provider, pretrain_gpt.train_valid_test_datasets_provider,
                      pretrain_gpt.forward_step, device)
    model = trainer.model.module.eval()
    with torch.no_grad():
        local = model(TOKENS, torch.arange(TOKENS.shape[1]).expand_as(TOKENS))  # [b, s, v / tp]
    pieces = [torch.empty_like(local) for _ in range(config.dims.tp)]
    dist.all_gather(pieces, local.contiguous(), group=trainer.pgs.tp)
    if rank == 0:
        torch.save(torch.cat(pieces, dim=-1), out_path)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_tp2_pp2_to_tp1_to_tp4_same_weights_and_logits(tmp_path):
    src = str(tmp_path / "tp2pp2")
    records = run_distributed(TRAIN + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                       "--save", src], 4)
    trained = merge_full_params(records)

    tp1 = str(tmp_path / "tp1")
    _convert(src, tp1, 1, 1)
    full = read_lsgd(tp1)
    assert full.params.keys() == trained.keys()
    for name, value in trained.items():
        assert torch.equal(full.params[name], value), name
    with torch.no_grad():
        logits_tp1 = to_module(full)(TOKENS, torch.arange(TOKENS.shape[1]).expand_as(TOKENS))

    tp4 = str(tmp_path / "tp4")
    _convert(tp1, tp4, 4, 1)
    out = str(tmp_path / "logits_tp4.pt")
    argv = TRAIN + ["--tensor-model-parallel-size", "4", "--load", tp4, "--no-load-optim", "--no-load-rng"]
    spawn(_logits_worker, args=(4, free_port(), argv, out), nprocs=4)
    logits_tp4 = torch.load(out, weights_only=True)
    assert logits_tp4.shape == logits_tp1.shape == (2, 16, 256)
    torch.testing.assert_close(logits_tp4, logits_tp1, rtol=0, atol=1e-5)
