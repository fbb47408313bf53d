"""Symmetric per-block absmax quantization (int8, packed int4) for inter-site payloads.

Each block of `block` values gets one fp32 scale = absmax / qmax (qmax 127 or 7); values
are rounded half-to-even to integers in [-qmax, qmax]. Per element the error is at most
scale / 2 = absmax(block) / (2 qmax). int4 stores q + 8 in a nibble, element 2i in the low
nibble of byte i.

CPU tensors go through the C++ kernels (megatron_lsgd._C, threaded); other devices, or a
build without the extension, use the torch fallback, which is bit-identical (tested).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

try:
    from megatron_lsgd import _C  # type: ignore[attr-defined]
except ImportError:  # extension not built: the torch path is complete on its own
    _C = None

QMAX = {8: 127.0, 4: 7.0}


def kernel_threads() -> int:
    return max(1, min(8, torch.get_num_threads(), os.cpu_count() or 1))


@dataclass
class Quantized:
    """Packed values and per-block scales of a flat fp32 tensor of `numel` elements."""

    packed: torch.Tensor  # uint8
    scales: torch.Tensor  # float32, one per block
    numel: int
    bits: int
    block: int

    @staticmethod
    def nbytes(numel: int, bits: int, block: int) -> int:
        data = numel if bits == 8 else (numel + 1) // 2
        return data + 4 * ((numel + block - 1) // block)

    def to_bytes(self) -> torch.Tensor:
        """One uint8 tensor (values then scales), the unit sent over the wire."""
        return torch.cat([self.packed, self.scales.view(torch.uint8)])

    @classmethod
    def from_bytes(cls, buf: torch.Tensor, numel: int, bits: int, block: int) -> "Quantized":
        data = numel if bits == 8 else (numel + 1) // 2
        scales = buf[data:].clone().view(torch.float32)  # clone: the view needs 4-byte alignment
        return cls(buf[:data], scales, numel, bits, block)


def _check(bits: int, block: int) -> None:
    if bits not in QMAX:
        raise ValueError(f"bits must be 4 or 8 (got {bits})")
    if block < 2 or block % 2:
        raise ValueError(f"block must be even and >= 2 (got {block})")


def quantize_torch(x: torch.Tensor, bits: int, block: int) -> Quantized:
    _check(bits, block)
    x = x.detach().reshape(-1).float()
    n = x.numel()
    qmax = QMAX[bits]
    nblocks = (n + block - 1) // block
    padded = torch.zeros(nblocks * block, dtype=torch.float32, device=x.device)
    padded[:n] = x
    blocks = padded.view(nblocks, block)
    scales = blocks.abs().amax(dim=1) / qmax
    divisor = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = torch.round(blocks / divisor[:, None]).clamp_(-qmax, qmax).to(torch.int32).reshape(-1)[:n]
    if bits == 8:
        packed = q.to(torch.int8).view(torch.uint8)
    else:
        q = q + 8
        if n % 2:
            q = torch.cat([q, torch.zeros(1, dtype=torch.int32, device=x.device)])  # empty high nibble
        packed = (q[0::2] | (q[1::2] << 4)).to(torch.uint8)
    return Quantized(packed, scales, n, bits, block)


def dequantize_torch(q: Quantized) -> torch.Tensor:
    n, block = q.numel, q.block
    if q.bits == 8:
        values = q.packed.view(torch.int8).to(torch.float32)
    else:
        b = q.packed.to(torch.int32)
        values = torch.stack([(b & 0xF) - 8, (b >> 4) - 8], dim=1).reshape(-1)[:n].to(torch.float32)
    nblocks = q.scales.numel()
    padded = torch.zeros(nblocks * block, dtype=torch.float32, device=values.device)
    padded[:n] = values
    return (padded.view(nblocks, block) * q.scales[:, None]).reshape(-1)[:n]


def quantize(x: torch.Tensor, bits: int, block: int, use_kernels: Optional[bool] = None) -> Quantized:
    use = (_C is not None and x.device.type == "cpu") if use_kernels is None else use_kernels
    if not use:
        return quantize_torch(x, bits, block)
    _check(bits, block)
    flat = x.detach().reshape(-1).float().contiguous()
    packed, scales = _C.quantize_blockwise(flat.numpy(), bits, block, kernel_threads())
    return Quantized(torch.from_numpy(packed), torch.from_numpy(scales), flat.numel(), bits, block)


def dequantize(q: Quantized, use_kernels: Optional[bool] = None) -> torch.Tensor:
    use = (_C is not None and q.packed.device.type == "cpu") if use_kernels is None else use_kernels
    if not use:
        return dequantize_torch(q)
    out = _C.dequantize_blockwise(q.packed.contiguous().numpy(), q.scales.contiguous().numpy(), q.bits, q.numel,
                                  q.block, kernel_threads())
    return torch.from_numpy(out)


def kernels_available() -> bool:
    return _C is not None
