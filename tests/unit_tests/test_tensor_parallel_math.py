"""Single-process checks of the pieces the multi-rank tests build on."""

import torch

from megatron_lsgd.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_lsgd.core.tensor_parallel.initialize import master_value, merge_tp_slices, take_tp_slice


def test_vocab_parallel_cross_entropy_matches_torch_on_one_rank():
    torch.manual_seed(0)
    logits = torch.randn(5, 3, 17, requires_grad=True)
    target = torch.randint(0, 17, (5, 3))
    ours = vocab_parallel_cross_entropy(logits, target, None)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 17), target.reshape(-1), reduction="none").view(5, 3)
    torch.testing.assert_close(ours, ref)
    (g_ours,) = torch.autograd.grad(ours.sum(), logits)
    (g_ref,) = torch.autograd.grad(ref.sum(), logits)
    torch.testing.assert_close(g_ours, g_ref)


def test_strided_slices_round_trip_and_keep_gate_up_pairs():
    full = torch.arange(16.0).view(8, 2)  # rows 0-3 gate, 4-7 up
    slices = [take_tp_slice(full, 0, 2, 2, r) for r in range(2)]
    assert slices[0][:, 0].tolist() == [0, 2, 8, 10]  # gate rows 0,1 + up rows 4,5
    assert torch.equal(merge_tp_slices(slices, 0, 2), full)


def test_master_value_is_a_function_of_name_and_seed():
    a = master_value("layers.0.w", (4, 4), "normal", 0.02, seed=1)
    assert torch.equal(a, master_value("layers.0.w", (4, 4), "normal", 0.02, seed=1))
    assert not torch.equal(a, master_value("layers.1.w", (4, 4), "normal", 0.02, seed=1))
    assert not torch.equal(a, master_value("layers.0.w", (4, 4), "normal", 0.02, seed=2))
