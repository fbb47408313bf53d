"""int8/int4 blockwise quantization: C++ kernels equal the torch fallback bit for bit,
and the per-element error stays within absmax(block) / (2 qmax)."""

import pytest
import torch

from megatron_lsgd.core.lsgd import quantization as qz

SIZES = [1, 2, 7, 63, 64, 65, 1000, 70001]


@pytest.mark.skipif(not qz.kernels_available(), reason="megatron_lsgd._C not built (python setup.py build_ext --inplace)")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [2, 32, 64, 128])
def test_kernels_match_torch_fallback(bits, block):
    g = torch.Generator().manual_seed(bits * 1000 + block)
    for n in SIZES:
        x = torch.randn(n, generator=g) * torch.logspace(-3, 2, n)
        x[: n // 5] = 0  # an all-zero block has scale 0
        x[-1:] = 0.5 * x[-1:].sign()  # exact .5 ties after scaling exercise round-half-even
        ck, ref = qz.quantize(x, bits, block, use_kernels=True), qz.quantize_torch(x, bits, block)
        assert torch.equal(ck.packed, ref.packed) and torch.equal(ck.scales, ref.scales), n
        assert torch.equal(qz.dequantize(ck, use_kernels=True), qz.dequantize_torch(ref)), n


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("use_kernels", [False, True] if qz.kernels_available() else [False])
def test_error_within_bound(bits, use_kernels):
    block = 64
    x = torch.randn(10_007, generator=torch.Generator().manual_seed(1)) * 3
    q = qz.quantize(x, bits, block, use_kernels=use_kernels)
    err = (qz.dequantize(q, use_kernels=use_kernels) - x).abs()
    n_blocks = q.scales.numel()
    padded = torch.zeros(n_blocks * block)
    padded[: x.numel()] = x
    bound = padded.view(n_blocks, block).abs().amax(1) / (2 * qz.QMAX[bits])
    per_elem = bound.repeat_interleave(block)[: x.numel()]
    assert (err <= per_elem * (1 + 1e-6) + 1e-12).all()
    assert err.max() > 0  # the test would notice a lossless (unpacked) path


def test_int4_packing_layout_and_wire_format():
    x = torch.tensor([7.0, -7.0, 0.0, 3.0, 1.0])
    q = qz.quantize_torch(x, 4, 2)
    # block scales: 7/7, 3/7 (ties away), 1/7; element 2i in the low nibble.
    assert q.packed.tolist() == [(7 + 8) | ((-7 + 8) << 4), (0 + 8) | ((7 + 8) << 4), 7 + 8]
    buf = q.to_bytes()
    assert buf.numel() == qz.Quantized.nbytes(5, 4, 2) == 3 + 3 * 4
    back = qz.Quantized.from_bytes(buf, 5, 4, 2)
    torch.testing.assert_close(qz.dequantize_torch(back), x, rtol=1e-6, atol=1e-6)
