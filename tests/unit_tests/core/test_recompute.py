"""Activation recomputation (--recompute-granularity/-method/-num-layers, Megatron's meaning):
training is bit-identical with and without it, dropout included (the tensor-parallel
tracker's states are replayed), fewer activations are kept for backward, a layer's forward
pre-hook can tell the recomputation from the forward, and bad flag combinations end in one
error line. World of one, in process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_lsgd.core.transformer import recompute
from tests.unit_tests.checkpointing.launch import TINY
from tests.unit_tests.checkpointing.single import run_single
from tests.unit_tests.harness import free_port

BASE = [a if a != "2" or i != 1 else "3" for i, a in enumerate(TINY)] + [
    "--train-iters", "3", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]  # 3 layers, dropout on


def _train(argv, monkeypatch):
    import pretrain_gpt

    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(k, v)
    try:
        result = pretrain_gpt.main(BASE + argv)
        model = result.model.module if hasattr(result.model, "module") else result.model
        params = {n: p.detach().clone() for n, p in model.global_named_parameters()}
        # activations kept for backward by one training-mode forward of the trained model
        saved = []
        tokens = torch.randint(0, 250, (2, 32))
        positions = torch.arange(32).expand(2, 32)
        model.train()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            model(tokens, positions, None, labels=tokens)
        return result.logged_losses, params, sum(saved)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_recomputation_changes_no_number_and_keeps_fewer_activations(monkeypatch):
    losses, params, kept = _train([], monkeypatch)
    assert BASE[1] == "3"
    variants = {"uniform 1": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                              "--recompute-num-layers", "1"],
                "uniform 2": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                              "--recompute-num-layers", "2"],  # chunks: layers 0-1, layer 2
                "block 1": ["--recompute-granularity", "full", "--recompute-method", "block",
                            "--recompute-num-layers", "1"],
                "selective": ["--recompute-granularity", "selective"]}
    kept_by = {}
    for name, flags in variants.items():
        other_losses, other_params, kept_by[name] = _train(flags, monkeypatch)
        assert other_losses == losses, name  # bit for bit, dropout masks replayed
        for n in params:
            assert torch.equal(other_params[n], params[n]), (name, n)
    assert kept_by["uniform 1"] < kept_by["block 1"] < kept
    assert kept_by["uniform 2"] < kept_by["block 1"]
    assert kept_by["selective"] < kept


def test_a_pre_hook_can_tell_the_recomputation():
    layer = torch.nn.Linear(4, 4)
    seen = []
    layer.register_forward_pre_hook(lambda _m, _a: seen.append(recompute.recomputing()))
    x = torch.randn(3, 4, requires_grad=True)
    recompute.checkpointed(lambda t: layer(t).relu(), None, x).sum().backward()
    assert seen == [False, True] and not recompute.recomputing()


def test_layer_chunks_follow_megatron():
    assert recompute.layer_chunks(None, None, None, 4) == [(0, 4, False)]
    assert recompute.layer_chunks("selective", None, None, 4) == [(0, 4, False)]
    assert recompute.layer_chunks("full", "uniform", 3, 4) == [(0, 3, True), (3, 4, True)]
    assert recompute.layer_chunks("full", "block", 2, 4) == [(0, 1, True), (1, 2, True), (2, 4, False)]
    assert recompute.layer_chunks("full", "block", 4, 4) == [(i, i + 1, True) for i in range(4)]


@pytest.mark.parametrize("flags, message", [
    (["--recompute-granularity", "full", "--recompute-num-layers", "1"],
     "--recompute-granularity full needs --recompute-method"),
    (["--recompute-granularity", "full", "--recompute-method", "block"], "--recompute-num-layers must be between 1"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "4"],
     "--recompute-num-layers must be between 1 and the layers of one pipeline stage (3)"),
    (["--recompute-granularity", "selective", "--recompute-method", "uniform"],
     "--recompute-method applies to --recompute-granularity full only"),
    (["--recompute-method", "uniform"], "--recompute-method needs --recompute-granularity full"),
])
def test_bad_recompute_flags(flags, message, monkeypatch, capsys):
    code = run_single(flags + ["--train-iters", "1"], monkeypatch, base=BASE[:-6])
    err = capsys.readouterr().err
    assert code == 2 and f"error: {message}" in err and "Traceback" not in err
