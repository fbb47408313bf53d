"""SparseLoCo's payload: chunked top-k with 2-bit values, exchanged sparse.

The flat vector is cut into chunks of `chunk` values (the last one zero-padded). Each
chunk keeps its `k` entries of largest magnitude and sends them as
    one fp32 scale a = the largest kept |v| of the chunk,
    k indices inside the chunk (int16, so chunk <= 65536),
    k 2-bit codes: a sign bit and a magnitude bit, |v| <= a/2 -> a/4, above -> 3a/4,
so a kept value is off by at most a/4 and a dropped one by itself; error feedback
(compressors.py) carries both into the next round.

A sum of sparse vectors from S sites is not sparse, so nothing is reduced on the way:
every site all-gathers the S payloads (per rank (S-1) x payload on the wire) and decodes
and adds them itself, in site order, so the mean is bit-identical on every site. What a
site contributed is decoded from its own payload by the same function, so the residual
it keeps matches what the others received from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_lsgd.core.lsgd.comm import InterSiteComm
from megatron_lsgd.core.lsgd.means import SideValues
from megatron_lsgd.core.lsgd.reduction import Reduction

MAX_CHUNK = 1 << 16  # indices travel as int16 (offset by 2^15)
_INDEX_OFFSET = 1 << 15


def topk_per_chunk(density: float, chunk: int) -> int:
    """Entries kept per chunk: density x chunk, rounded, at least 1."""
    return min(chunk, max(1, round(density * chunk)))


@dataclass(frozen=True)
class SparseLayout:
    """Byte layout of one site's payload for a vector of `numel` values."""

    numel: int
    chunk: int
    k: int

    @property
    def chunks(self) -> int:
        return -(-self.numel // self.chunk)

    @property
    def kept(self) -> int:
        return self.chunks * self.k

    @property
    def scale_bytes(self) -> int:
        return 4 * self.chunks

    @property
    def index_bytes(self) -> int:
        return 2 * self.kept

    @property
    def code_bytes(self) -> int:
        return -(-self.kept // 4)

    @property
    def nbytes(self) -> int:
        return self.scale_bytes + self.index_bytes + self.code_bytes


def encode(x: torch.Tensor, layout: SparseLayout) -> torch.Tensor:
    """Flat fp32 `x` -> the uint8 payload (scales, indices, packed codes)."""
    padded = torch.zeros(layout.chunks * layout.chunk, dtype=torch.float32, device=x.device)
    padded[:layout.numel] = x.reshape(-1)
    chunks = padded.view(layout.chunks, layout.chunk)
    idx = torch.topk(chunks.abs(), layout.k, dim=1, sorted=False).indices
    vals = torch.gather(chunks, 1, idx)
    scale = vals.abs().amax(dim=1)
    big = vals.abs() > scale.unsqueeze(1) / 2
    codes = ((vals < 0).to(torch.uint8) << 1) | big.to(torch.uint8)
    codes = torch.cat([codes.reshape(-1), codes.new_zeros(4 * layout.code_bytes - layout.kept)]).view(-1, 4)
    packed = codes[:, 0] | (codes[:, 1] << 2) | (codes[:, 2] << 4) | (codes[:, 3] << 6)
    index16 = (idx.to(torch.int32) - _INDEX_OFFSET).to(torch.int16).reshape(-1)
    return torch.cat([scale.view(torch.uint8), index16.view(torch.uint8), packed])


def decode(payload: torch.Tensor, layout: SparseLayout, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Payload -> the dense fp32 vector it stands for (length numel). With `out` (length
    chunks x chunk, padded), adds into it instead."""
    s_end = layout.scale_bytes
    i_end = s_end + layout.index_bytes
    scale = payload[:s_end].clone().view(torch.float32)  # clone: a float view needs aligned storage
    index = payload[s_end:i_end].clone().view(torch.int16).to(torch.int64) + _INDEX_OFFSET
    packed = payload[i_end:i_end + layout.code_bytes]
    codes = torch.stack([(packed >> s) & 3 for s in (0, 2, 4, 6)], dim=1).reshape(-1)[:layout.kept]
    magnitude = torch.where((codes & 1).bool(), 0.75, 0.25).view(layout.chunks, layout.k) * scale.unsqueeze(1)
    vals = torch.where((codes >> 1).bool().view(layout.chunks, layout.k), -magnitude, magnitude)
    flat_index = (index.view(layout.chunks, layout.k)
                  + torch.arange(layout.chunks, device=index.device).unsqueeze(1) * layout.chunk).reshape(-1)
    dense = out if out is not None else torch.zeros(layout.chunks * layout.chunk, dtype=torch.float32,
                                                     device=payload.device)
    dense.index_add_(0, flat_index, vals.reshape(-1))  # indices are unique within one payload
    return dense[:layout.numel]


def sparse_mean(comm: InterSiteComm, x: torch.Tensor, chunk: int, k: int,
                side: Optional[SideValues] = None) -> Reduction:
    """Generator: mean over sites of flat fp32 `x`, each site sending its top-k 2-bit
    payload. Returns (mean, this rank's decoded contribution); `side` rides along."""
    layout = SparseLayout(x.numel(), chunk, k)
    mine = encode(x.detach().float(), layout)
    buf = mine if side is None else torch.cat([mine, side.raw(mine.device)])
    s = comm.num_sites
    gathered = torch.empty(s * buf.numel(), dtype=torch.uint8, device=buf.device)
    yield comm.all_gather(gathered, buf, async_op=True)
    parts = gathered.view(s, -1)
    if side is not None:
        side.average_raw([p[layout.nbytes:] for p in parts], s)
    total = torch.zeros(layout.chunks * chunk, dtype=torch.float32, device=x.device)
    for part in parts:  # site order: identical sums everywhere
        decode(part[:layout.nbytes].to(x.device), layout, out=total)
    return total[:layout.numel] / s, decode(mine, layout).to(x.device)
