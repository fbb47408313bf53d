"""AllReduce-compatible means of flat fp32 vectors across sites: exact, quantized, low rank.

Every mean here is a generator: it issues one asynchronous inter-site collective, yields
its handle, and resumes (computing the next phase) once the handle completes
(`reduction.py` drives it, blocking or between inner steps). All sites run identical
arithmetic on identical received bytes, so every site ends with a bit-identical mean.

Quantized mean, two variants (`--lsgd-quantized-mean`):
- allgather: each site quantizes its whole payload once and all-gathers it; everyone
  dequantizes the S payloads and sums them in site order. Per rank (S-1) x payload on the
  wire, one quantization, one collective latency.
- alltoall: reduce-scatter by all-to-all of quantized chunks, each site dequantizes and
  sums its chunk in fp32, requantizes the mean chunk, all-gathers it. Per rank 2 (S-1)/S
  x payload (like a ring all-reduce), two quantizations, two latencies. With int8/int4 the
  chunk's owner feeds its requantization error back into its next round's chunk.
`auto` picks allgather for S <= 2 (same bytes, fewer latencies, less error) and alltoall
above (its traffic stays flat in S).

Low rank (PowerSGD-style, one power iteration, warm-started): mean of P = M Q,
orthonormalize, mean of Q = M^T P_hat; see `lowrank_mean`.

Side values (`SideValues`): every mean takes an optional handful of fp32 values that ride
in its last collective, uncompressed, and are averaged exactly (summed in site order), so
sites can agree on small control numbers (CoCoDC's measured step and transfer times)
without a message of their own. Without side values every code path is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from megatron_lsgd.core.lsgd.comm import InterSiteComm
from megatron_lsgd.core.lsgd.quantization import Quantized, dequantize, quantize
from megatron_lsgd.core.lsgd.reduction import Reduction


def choose_variant(variant: str, num_sites: int) -> str:
    if variant == "auto":
        return "allgather" if num_sites <= 2 else "alltoall"
    return variant


class SideValues:
    """A few fp32 values carried, uncompressed, in a reduction's last collective and averaged
    exactly. `mean` is set when the reduction finishes and is bit-identical on every member
    of the group (sums run in site order, or inside one all-reduce)."""

    def __init__(self, values: torch.Tensor):
        self.values = values.detach().float().reshape(-1).clone()
        self.mean: Optional[torch.Tensor] = None

    def raw(self, device) -> torch.Tensor:
        """The values as bytes, to append to a byte payload."""
        return self.values.to(device).view(torch.uint8)

    def average_raw(self, chunks: List[torch.Tensor], num_sites: int) -> None:
        """`chunks`: every site's raw bytes, in site order."""
        total = torch.zeros_like(self.values)
        for chunk in chunks:
            total += chunk.clone().view(torch.float32).to(total.device)
        self.mean = total / num_sites


# ---- means of one flat fp32 vector -----------------------------------------------------------------
def fp32_mean(comm: InterSiteComm, x: torch.Tensor, side: Optional[SideValues] = None) -> Reduction:
    """Exact mean (ring all-reduce of fp32). Returns (mean, what this rank contributed)."""
    if side is None:
        out = x.detach().float().clone()
    else:
        out = torch.cat([x.detach().float().reshape(-1), side.values.to(x.device)])
    yield comm.all_reduce_mean(out, async_op=True)
    if side is not None:
        n = x.numel()
        side.mean = out[n:].clone()
        out = out[:n].reshape(x.shape)
    return out, x


def _allgather_mean(comm: InterSiteComm, x: torch.Tensor, bits: int, block: int,
                    side: Optional[SideValues] = None) -> Reduction:
    n, s = x.numel(), comm.num_sites
    q = quantize(x, bits, block)
    buf = q.to_bytes()
    qn = buf.numel()
    if side is not None:
        buf = torch.cat([buf, side.raw(buf.device)])
    out = torch.empty(s * buf.numel(), dtype=torch.uint8, device=buf.device)
    yield comm.all_gather(out, buf, async_op=True)
    total = torch.zeros(n, dtype=torch.float32, device=x.device)
    chunks = out.view(s, -1)
    if side is not None:
        side.average_raw([c[qn:] for c in chunks], s)
        chunks = [c[:qn] for c in chunks]
    for chunk in chunks:  # site order: identical sums everywhere
        total += dequantize(Quantized.from_bytes(chunk, n, bits, block)).to(x.device)
    return total / s, dequantize(q).to(x.device)


class RequantizationFeedback:
    """Error feedback for the all-to-all variant's second quantization: the site that owns a
    chunk adds what its last requantization of that chunk lost before requantizing the next
    round's mean, so that error reaches the anchor a round later instead of being dropped."""

    def __init__(self):
        self.residual: Optional[torch.Tensor] = None

    def requantize(self, chunk_mean: torch.Tensor, bits: int, block: int) -> Quantized:
        if self.residual is None:
            self.residual = torch.zeros_like(chunk_mean)
        if self.residual.shape != chunk_mean.shape:
            raise ValueError(f"requantization residual holds {self.residual.numel()} values, the chunk "
                             f"{chunk_mean.numel()}: the payload size changed between rounds")
        target = chunk_mean + self.residual
        q = quantize(target, bits, block)
        self.residual = target - dequantize(q).to(target.device)
        return q


def _alltoall_mean(comm: InterSiteComm, x: torch.Tensor, bits: int, block: int,
                   feedback: Optional[RequantizationFeedback] = None, side: Optional[SideValues] = None) -> Reduction:
    n, s = x.numel(), comm.num_sites
    chunk = -(-n // (s * block)) * block  # whole blocks per site chunk
    padded = torch.zeros(s * chunk, dtype=torch.float32, device=x.device)
    padded[:n] = x
    mine = [quantize(c, bits, block) for c in padded.view(s, chunk)]
    send = torch.cat([m.to_bytes() for m in mine])
    recv = torch.empty_like(send)
    yield comm.all_to_all(recv, send, async_op=True)
    own = torch.zeros(chunk, dtype=torch.float32, device=x.device)
    for part in recv.view(s, -1):
        own += dequantize(Quantized.from_bytes(part, chunk, bits, block)).to(x.device)
    own /= s
    reduced = feedback.requantize(own, bits, block) if feedback is not None else quantize(own, bits, block)
    reduced = reduced.to_bytes()
    rn = reduced.numel()
    if side is not None:  # rides in the second (last) collective
        reduced = torch.cat([reduced, side.raw(reduced.device)])
    gathered = torch.empty(s * reduced.numel(), dtype=torch.uint8, device=reduced.device)
    yield comm.all_gather(gathered, reduced, async_op=True)
    parts = gathered.view(s, -1)
    if side is not None:
        side.average_raw([p[rn:] for p in parts], s)
        parts = [p[:rn] for p in parts]
    mean = torch.cat([dequantize(Quantized.from_bytes(p, chunk, bits, block)) for p in parts])
    sent = torch.cat([dequantize(m) for m in mine])
    return mean[:n].to(x.device), sent[:n].to(x.device)


def quantized_mean(comm: InterSiteComm, x: torch.Tensor, bits: Optional[int], block: int,
                   variant: str = "auto", feedback: Optional[RequantizationFeedback] = None,
                   side: Optional[SideValues] = None) -> Reduction:
    """Mean over sites of a flat fp32 vector. Returns (mean, this rank's dequantized
    contribution); bits None sends fp32. `feedback` (all-to-all only) carries the owner's
    requantization error from round to round; `side` rides along (see SideValues)."""
    if bits is None:
        return (yield from fp32_mean(comm, x, side))
    if choose_variant(variant, comm.num_sites) == "allgather":
        return (yield from _allgather_mean(comm, x, bits, block, side))
    return (yield from _alltoall_mean(comm, x, bits, block, feedback, side))


def payload_bytes(numel: int, bits: Optional[int], block: int) -> int:
    return 4 * numel if bits is None else Quantized.nbytes(numel, bits, block)


# ---- low rank (PowerSGD-style, one power iteration, warm-started) ------------------------------
def orthonormalize(p: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(p, mode="reduced")[0]


def effective_rank(p: torch.Tensor, energy: float) -> int:
    """Smallest k whose top-k singular values hold >= `energy` of sum(sigma^2)."""
    sq = torch.linalg.svdvals(p.double()).pow(2)
    total = float(sq.sum())
    if total == 0.0:
        return 1
    # A Python scalar, not a host tensor: searchsorted wants its values on the boundaries' device.
    k = int(torch.searchsorted(torch.cumsum(sq, 0) / total, float(energy)).item()) + 1
    return min(k, sq.numel())


@dataclass
class LowRankResult:
    mean: List[torch.Tensor]  # per matrix, identical on every site
    sent: List[torch.Tensor]  # per matrix, what this rank contributed (P_hat Q_i^T)
    rest_mean: torch.Tensor
    rest_sent: torch.Tensor
    q_mean: List[torch.Tensor]  # warm start for the next round (identical on every site)
    effective_ranks: List[int]


def lowrank_mean(comm: InterSiteComm, mats: List[torch.Tensor], qs: List[torch.Tensor], rest: torch.Tensor,
                 bits: Optional[int], block: int, variant: str, energy: float,
                 side: Optional[SideValues] = None) -> Reduction:
    """Two phases: mean of P = M Q; orthonormalize; mean of Q = M^T P_hat together with the
    uncompressed-by-rank remainder `rest` (1-D tensors and small matrices); `side` rides in
    the second phase."""
    ps = [m @ q for m, q in zip(mats, qs)]
    flat_p = torch.cat([p.reshape(-1) for p in ps]) if ps else rest.new_zeros(0)
    p_mean, _ = yield from quantized_mean(comm, flat_p, bits, block, variant)
    p_hats, eff = [], []
    offset = 0
    for p in ps:
        p_avg = p_mean[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
        eff.append(effective_rank(p_avg, energy))
        p_hats.append(orthonormalize(p_avg))
    new_qs = [m.t() @ ph for m, ph in zip(mats, p_hats)]
    flat_q = torch.cat([q.reshape(-1) for q in new_qs] + [rest.reshape(-1)])
    q_mean, q_sent = yield from quantized_mean(comm, flat_q, bits, block, variant, side=side)
    means, sents, q_means = [], [], []
    offset = 0
    for ph, q in zip(p_hats, new_qs):
        qm = q_mean[offset:offset + q.numel()].view_as(q)
        qs_ = q_sent[offset:offset + q.numel()].view_as(q)
        offset += q.numel()
        means.append(ph @ qm.t())
        sents.append(ph @ qs_.t())
        q_means.append(qm.clone())
    return LowRankResult(means, sents, q_mean[offset:].clone(), q_sent[offset:].clone(), q_means, eff)
