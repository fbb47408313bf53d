"""--optimizer muon: the Newton-Schulz step against torch.optim.Muon on one matrix, and
TP2 x PP2 x ZeRO-1 (8 ranks) training exactly like one rank (each matrix assembled from
its TP slices and ZeRO-1 pieces before the orthogonalization)."""

from __future__ import annotations

import pytest
import torch

from megatron_lsgd.core.optimizer.muon import is_muon_matrix, muon_lr, newton_schulz
from tests.unit_tests.harness import assert_replicas_identical, logged_losses, merge_full_params, run_distributed
from tests.unit_tests.core.test_layout_equivalence import COMMON, LLAMA


def test_newton_schulz_orthogonalizes_and_matches_torch_muon_step():
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(48, 20, generator=g)
    o = newton_schulz(grad, 5)
    s = torch.linalg.svdvals(o)
    assert s.min() > 0.5 and s.max() < 1.5  # Muon's quintic: singular values pushed into ~[0.7, 1.2]
    assert torch.equal(newton_schulz(grad.T, 5), o.T)
    # torch.optim.Muon (bf16 iteration) and ours (fp32) take the same steps, to bf16 accuracy
    w0 = torch.randn(48, 20, generator=g)
    ref = torch.nn.Parameter(w0.clone())
    opt = torch.optim.Muon([ref], lr=0.01, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    ours, buf = w0.clone(), torch.zeros_like(w0)
    for _ in range(3):
        grad = torch.randn(48, 20, generator=g)
        ref.grad = grad.clone()
        opt.step()
        buf.mul_(0.95).add_(grad)
        ours.mul_(1 - 0.01 * 0.1).sub_(newton_schulz(grad + 0.95 * buf, 5), alpha=muon_lr(0.01, (48, 20)))
    moved = (ref.detach() - w0).norm()
    assert (ours - ref.detach()).norm() < 0.03 * moved
    assert is_muon_matrix("decoder.layers.0.mlp.linear_fc1.weight", torch.nn.Parameter(torch.zeros(4, 4)))
    assert not is_muon_matrix("embedding.word_embeddings.weight", torch.nn.Parameter(torch.zeros(4, 4)))
    assert not is_muon_matrix("output_layer.weight", torch.nn.Parameter(torch.zeros(4, 4)))
    assert not is_muon_matrix("decoder.final_layernorm.weight", torch.nn.Parameter(torch.zeros(4)))


@pytest.mark.slow
def test_muon_under_tp2_pp2_zero1_equals_one_rank():
    args = COMMON + LLAMA + ["--optimizer", "muon"]
    single = run_distributed(args, 1)
    layout = run_distributed(args + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                     "--use-distributed-optimizer", "--ddp-bucket-size", "3000"], 8)
    losses = logged_losses(single)
    assert losses[-1] < losses[0]
    torch.testing.assert_close(torch.tensor(logged_losses(layout)), torch.tensor(losses), rtol=1e-5, atol=0)
    ref, got = merge_full_params(single), merge_full_params(layout)
    muon = [n for n in ref if ".layers." in f".{n}" and ref[n].ndim == 2]
    assert len(muon) == 8  # qkv, proj, fc1, fc2 of both layers
    for name in ref:  # Muon's matrices to 1e-6; AdamW's parameters as in test_layout_equivalence
        torch.testing.assert_close(got[name], ref[name], rtol=0 if name in muon else 1e-5, atol=1e-6, msg=name)
    assert_replicas_identical(layout)


@pytest.mark.slow
def test_muloco_and_acco_with_muon_under_tp2_and_two_sites():
    """Muon inside each site under diloco (MuLoCo) and under acco, whose worker thread steps the
    optimizer on groups of its own (tp included): finite, learning, identical replicas."""
    from tests.unit_tests.harness import run_distributed_many

    args = COMMON + LLAMA + ["--optimizer", "muon", "--tensor-model-parallel-size", "2", "--num-sites", "2",
                             "--train-iters", "4"]
    runs = run_distributed_many([args + ["--lsgd-algorithm", "diloco", "--lsgd-interval", "2"],
                                 args + ["--lsgd-algorithm", "acco", "--lsgd-accumulation", "fixed"]], 4)
    for run in runs:
        losses = logged_losses(run)
        assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
        assert_replicas_identical(run)


@pytest.mark.slow
def test_muon_resumes_bit_exact_under_zero1(tmp_path):
    """The sharded Muon momentum is saved and restored: 2 + 2 steps equal 4 steps."""
    from tests.unit_tests.checkpointing.launch import TINY, assert_same, load_tree, losses, read, run

    common = TINY + ["--optimizer", "muon", "--use-distributed-optimizer", "--ddp-bucket-size", "3000",
                     "--global-batch-size", "4", "--hidden-dropout", "0", "--attention-dropout", "0",
                     "--lr-decay-iters", "4", "--save-interval", "2"]
    run(common + ["--train-iters", "4", "--save", str(tmp_path / "ref")], 2, str(tmp_path / "ref.log"), timeout=300)
    ckpt = str(tmp_path / "ckpt")
    run(common + ["--train-iters", "2", "--save", ckpt], 2, str(tmp_path / "a.log"), timeout=300)
    run(common + ["--train-iters", "4", "--save", ckpt, "--load", ckpt], 2, str(tmp_path / "b.log"), timeout=300)
    ref, resumed = losses(read(str(tmp_path / "ref.log"))), losses(read(str(tmp_path / "b.log")))
    assert sorted(resumed) == [3, 4] and all(resumed[it] == ref[it] for it in resumed)
    final = "iter_0000004"
    assert_same(load_tree(str(tmp_path / "ref" / final)), load_tree(str(tmp_path / "ckpt" / final)), final)
