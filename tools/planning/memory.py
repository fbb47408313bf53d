"""Memory per GPU of a planned job, by component (tools/plan.py).

The layout is this project's (docs/architecture.md): bf16 weights, an fp32 gradient buffer
(`main_grad`), ZeRO-1 over the site's DP_intra ranks for the fp32 main parameters and AdamW's
two moments. What an algorithm adds lives on each rank's main shard:
- the DiLoCo family's outer state (core/lsgd/outer_state.py): the fp32 anchor, plus the outer
  momentum when the outer step uses one;
- a compressor's error feedback (core/lsgd/compressors.py): one fp32 residual of the shard;
- acco/dpu: the doubled gradient buffer (the next step's gradients are computed while the
  last ones are reduced) and the worker's fp32 copy of the parameters it steps.
Activations follow Korthikanti et al. (2022), per layer and micro-batch:
s b h (34 + 5 a s / h) bytes, divided by TP (sequence parallel assumed); selective
recomputation drops the 5 a s / h attention term, full recomputation keeps each layer's input
(2 s b h). The 1F1B schedule keeps up to PP micro-batches in flight on the first stage, so a
stage holds (layers / PP) x min(PP, micro-batches per step) layers' worth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

GIB = 1024 ** 3

# What each algorithm keeps beyond sync, per parameter of its shard (bytes), with its
# recommended settings (recipes.recommended: outer momentum 0).
OUTER_ANCHOR = {"diloco", "dilocox", "streaming-diloco", "cocodc", "edit", "a-edit"}
DOUBLE_GRADIENTS = {"acco", "dpu"}


@dataclass
class Memory:
    weights: float
    gradients: float
    optimizer: float
    outer_state: float
    compressor: float
    algorithm_buffers: float
    activations: float

    @property
    def total(self) -> float:
        return sum(self.as_dict().values())

    def as_dict(self) -> Dict[str, float]:
        return {"weights": self.weights, "gradients": self.gradients, "optimizer": self.optimizer,
                "outer_state": self.outer_state, "compressor": self.compressor,
                "algorithm_buffers": self.algorithm_buffers, "activations": self.activations}


def activation_bytes(seq: int, micro_batch: int, hidden: int, heads: int, layers: int, tp: int, pp: int,
                     recompute: str, microbatches: int) -> float:
    """Activations the first pipeline stage holds at its peak (see the module's docstring)."""
    sbh = seq * micro_batch * hidden
    if recompute == "full":
        per_layer = 2 * sbh
    elif recompute == "selective":
        per_layer = 34 * sbh / tp
    else:
        per_layer = sbh * (34 + 5 * heads * seq / hidden) / tp
    return per_layer * (layers / pp) * min(pp, microbatches)


def memory_per_gpu(params: float, tp: int, pp: int, dp_intra: int, algorithm: str, compression: str,
                   outer_momentum: bool, seq: int, micro_batch: int, hidden: int, heads: int, layers: int,
                   recompute: str, microbatches: int) -> Memory:
    """Bytes on one GPU of a site (the first pipeline stage, which holds the most activations)."""
    local = params / (tp * pp)      # this rank's parameters
    shard = local / dp_intra        # its ZeRO-1 shard
    outer = 0.0
    if algorithm in OUTER_ANCHOR:
        outer = (8 if outer_momentum else 4) * shard
    compressor = 4 * shard if compression != "none" else 0.0
    buffers = (4 * local + 4 * shard) if algorithm in DOUBLE_GRADIENTS else 0.0
    return Memory(weights=2 * local, gradients=4 * local, optimizer=12 * shard, outer_state=outer,
                  compressor=compressor, algorithm_buffers=buffers,
                  activations=activation_bytes(seq, micro_batch, hidden, heads, layers, tp, pp, recompute,
                                                               microbatches))
