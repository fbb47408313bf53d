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


def _new_full_fp32_buffers(fn, numel):
    """How many fp32 tensors of `numel` values `fn` allocates (outputs not written in place)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            for o in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(o, torch.Tensor) and o.dtype == torch.float32 and o.numel() == numel \
                        and o.untyped_storage().data_ptr() not in inputs:
                    Count.n += 1
            return out

    with Count():
        fn()
    return Count.n


def test_vocab_parallel_cross_entropy_keeps_one_fp32_logits_buffer():
    torch.manual_seed(0)
    target = torch.randint(0, 17, (5, 3))
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(5, 3, 17).to(dtype).requires_grad_()
        before = logits.detach().clone()
        assert _new_full_fp32_buffers(lambda: vocab_parallel_cross_entropy(logits, target, None), 5 * 3 * 17) == 1
        assert torch.equal(logits.detach(), before)  # the input is never written
        # bf16 logits: exactly what their fp32 values give
        wide = logits.detach().float().requires_grad_()
        ours, ref = vocab_parallel_cross_entropy(logits, target, None), vocab_parallel_cross_entropy(wide, target, None)
        assert torch.equal(ours, ref)
        (g_ours,), (g_ref,) = torch.autograd.grad(ours.sum(), logits), torch.autograd.grad(ref.sum(), wide)
        assert torch.equal(g_ours, g_ref.to(dtype))


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
