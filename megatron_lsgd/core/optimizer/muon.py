"""Muon for the 2-D hidden matrices of a TP x ZeRO-1 sharded model (`--optimizer muon`).

Muon (Jordan et al.) keeps a Nesterov momentum per matrix and steps along the momentum's
orthogonalization, approximated by a quintic Newton-Schulz iteration. The momentum is
elementwise, so it lives sharded exactly like an AdamW moment (one fp32 buffer per piece
of this rank's ZeRO-1 shard). The orthogonalization needs the whole matrix, assembled
per step in two collectives over all Muon matrices of the stage at once:

1. dp_intra (ZeRO-1 only): every rank writes the momentum-mixed update of its own pieces
   into a zeroed flat buffer holding every Muon matrix's local TP slice, and the site
   all-reduces it. Pieces are disjoint, so each value is added to zeros only: exact.
   Cost per rank: a ring all-reduce of the stage's Muon parameters / TP (fp32).
2. tp (TP > 1): the flat buffer is all-gathered across TP ranks and each matrix is
   merged with the layers' own partition metadata (`merge_tp_slices`: fused QKV groups,
   SwiGLU's stride 2), giving exactly the matrix one rank would hold.
   Cost per rank: (TP - 1) x the stage's Muon parameters / TP (fp32).

Then every rank that holds a piece of a matrix runs Newton-Schulz on the whole matrix
(redundant: up to TP x (the dp_intra ranks its pieces span) times per matrix) and
applies only its own piece. So no rank owns a matrix and nothing is sent back; the price
is the duplicated iteration (5 x 3 matmuls of the matrix's size per holder).

The iteration runs in fp32 (torch.optim.Muon casts to bf16): the same matrix gives the
same bits in every layout, which is what lets TP2 x PP2 x ZeRO-1 match one rank to 1e-6.
The step size follows Moonshot's rule (torch's `adjust_lr_fn="match_rms_adamw"`):
lr x 0.2 x sqrt(max(rows, cols)), so `--lr` and its schedule serve Muon and AdamW alike;
decoupled weight decay lr x wd as in torch.optim.Muon.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_lsgd.core.distributed.collectives import all_gather_flat
from megatron_lsgd.core.tensor_parallel.initialize import merge_tp_slices, take_tp_slice

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Muon's quintic (maximal slope at zero)


def is_muon_matrix(name: str, param: torch.nn.Parameter) -> bool:
    """Hidden 2-D weights; embeddings and the output head stay with AdamW (as Muon's authors)."""
    return param.ndim == 2 and not name.startswith("embedding.") and not name.startswith("output_layer.")


def newton_schulz(g: torch.Tensor, steps: int, eps: float = 1e-7) -> torch.Tensor:
    """Approximate U V^T of g = U S V^T (fp32), iterating on the wide orientation."""
    a, b, c = NS_COEFFICIENTS
    x = g.float()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def muon_lr(lr: float, shape: Sequence[int]) -> float:
    """Per-matrix step size matching AdamW's update RMS (Moonshot)."""
    return lr * 0.2 * math.sqrt(max(shape[0], shape[1]))


class ShardedMuon:
    """`pieces`: this rank's ShardPieces of Muon matrices (with p_lo/p_hi: where the piece sits
    in the parameter's flattened local slice); `params`: every Muon matrix of the stage in
    buffer order (identical on all ranks of the stage's tp x dp_intra block)."""

    def __init__(self, pieces: List[object], params: List[torch.nn.Parameter], pgs, sharded: bool,
                 momentum: float, ns_steps: int, weight_decay: float):
        self.pieces = pieces
        self.params = params
        self.pgs = pgs
        self.sharded = sharded
        self.momentum, self.ns_steps, self.weight_decay = momentum, ns_steps, weight_decay
        self.offsets: Dict[int, int] = {}
        total = 0
        for p in params:
            self.offsets[id(p)] = total
            total += p.numel()
        self.total = total
        self.buffers = [torch.zeros_like(pc.main) for pc in pieces]

    def _assemble(self, updates: List[torch.Tensor], groups) -> List[torch.Tensor]:
        """Each TP rank's flat buffer of every Muon matrix's local slice (the update, whole)."""
        device = self.params[0].device
        flat = torch.zeros(self.total, dtype=torch.float32, device=device)
        for pc, u in zip(self.pieces, updates):
            start = self.offsets[id(pc.param)]
            flat[start + pc.p_lo:start + pc.p_hi] = u
        if self.sharded:
            dist.all_reduce(flat, group=groups.dp_intra)
        tp = self.pgs.dims.tp
        if tp == 1:
            return [flat]
        gathered = torch.empty(tp * self.total, dtype=torch.float32, device=device)
        all_gather_flat(gathered, flat, group=groups.tp)
        return list(gathered.view(tp, self.total))

    @torch.no_grad()
    def step(self, grads: List[torch.Tensor], lr: float, groups=None) -> None:
        if not self.params:
            return
        groups = groups or self.pgs
        updates = []
        for g, buf in zip(grads, self.buffers):
            buf.mul_(self.momentum).add_(g)
            updates.append(g.add(buf, alpha=self.momentum))  # Nesterov, as torch.optim.Muon
        per_rank = self._assemble(updates, groups)
        by_param: Dict[int, List[object]] = {}
        for pc in self.pieces:
            by_param.setdefault(id(pc.param), []).append(pc)
        tp, tp_rank = self.pgs.dims.tp, self.pgs.tp_rank
        for p in self.params:
            mine = by_param.get(id(p))
            if not mine:
                continue
            start = self.offsets[id(p)]
            slices = [flat[start:start + p.numel()].view(p.shape) for flat in per_rank]
            partitioned = getattr(p, "tensor_model_parallel", False) and tp > 1
            full = merge_tp_slices(slices, p.partition_dim, p.partition_stride) if partitioned else slices[0]
            ortho = newton_schulz(full, self.ns_steps)
            local = take_tp_slice(ortho, p.partition_dim, p.partition_stride, tp, tp_rank) if partitioned else ortho
            local = local.reshape(-1)
            step = muon_lr(lr, full.shape)
            for pc in mine:
                if self.weight_decay:
                    pc.main.mul_(1 - lr * self.weight_decay)
                pc.main.sub_(local[pc.p_lo:pc.p_hi], alpha=step)

    def state_dict(self) -> Dict:
        return {"momentum": [b.clone() for b in self.buffers]}

    def load_state_dict(self, state: Optional[Dict]) -> None:
        if state is None:
            raise ValueError("the checkpoint holds no Muon state (it was saved with another --optimizer)")
        for b, saved in zip(self.buffers, state["momentum"]):
            b.copy_(saved)
