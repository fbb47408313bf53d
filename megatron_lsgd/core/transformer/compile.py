"""`--compile`: regional compilation, each transformer layer's forward compiled on its own.

Only `TransformerLayer.forward` is handed to `torch.compile`, per layer, not the model:
- compile time does not grow with depth: every layer runs the same code, so the layers share
  one compiled graph (dynamo caches by code object; parameters are graph inputs);
- a pipeline stage compiles only the layers it holds;
- the synchronizers' unit hooks (edit/a-edit's forward pre-hooks, dreamddp's profile hooks)
  run in `nn.Module.__call__`, around the compiled forward, so they sit at layer boundaries
  and never break a layer's graph; gradient hooks (the flat buffer's, dreamddp's per-unit
  backward) fire in autograd after the layer's compiled backward has produced the gradient;
- full recomputation checkpoints whole chunks of layers: the compiled forward is simply run
  again in backward; selective recomputation's checkpoint, inside the layer, is traced as
  dynamo's own checkpoint (`recompute.checkpointed`).
Element-wise work inside a layer (RMSNorm, RoPE's rotate-half and its concatenation, SwiGLU,
the residual adds, dropout) is fused by inductor; the eager path is untouched (no flag, no
change: the regression fixtures are bit-exact without --compile).

`CompileReport` reads dynamo's process-wide counters and says, once, how many graphs the
warm-up step compiled, how many graph breaks tracing found and how many frames the next
step compiled again (recompilations; 0 when the graphs are stable).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torch import nn


def compile_layers(layers: Iterable[nn.Module], fresh: bool = True) -> int:
    """Compiles each layer's forward in place (hooks stay outside); returns how many.
    `fresh`: first drop dynamo's caches, so a process that trains several times (tests, tools)
    compiles each run's layers anew instead of reaching dynamo's recompile limit, past which it
    would silently run the forward eagerly. Inductor's on-disk cache still serves a repeat."""
    if fresh:
        torch._dynamo.reset()
    n = 0
    for layer in layers:
        layer.forward = torch.compile(layer.forward)
        n += 1
    return n


def _counters():
    from torch._dynamo.utils import counters  # dynamo's process-wide tallies

    return counters


@dataclass(frozen=True)
class CompileCounts:
    graphs: int  # graphs dynamo handed to the backend
    graph_breaks: int  # breaks found while tracing (each splits a frame into more graphs)
    frames: int  # frames compiled (a recompilation compiles a frame again)

    @classmethod
    def now(cls) -> "CompileCounts":
        c = _counters()
        return cls(c["stats"]["unique_graphs"], sum(c["graph_break"].values()), c["frames"]["ok"])

    def __sub__(self, other: "CompileCounts") -> "CompileCounts":
        return CompileCounts(self.graphs - other.graphs, self.graph_breaks - other.graph_breaks,
                             self.frames - other.frames)


def break_reasons(limit: int = 3) -> str:
    reasons = list(_counters()["graph_break"])
    return "; ".join(r.splitlines()[0][:120] for r in reasons[:limit]) if reasons else ""


class CompileReport:
    """One line after the step following `warmup_steps`: the warm-up's graphs and graph breaks,
    and the graph breaks and recompilations of the step after it."""

    def __init__(self, num_layers: int, warmup_steps: int = 1):
        self.num_layers = num_layers
        self.warmup_steps = warmup_steps
        self.start = CompileCounts.now()
        self.after_warmup: Optional[CompileCounts] = None
        self.done = False
        self.counts: Optional[dict] = None  # the line's figures, once printed (TrainingResult.compile_counts)

    def after_step(self, iteration: int) -> Optional[str]:
        """`iteration`: steps taken so far. Returns the line once, when it is due."""
        if self.done or iteration < self.warmup_steps:
            return None
        if self.after_warmup is None:
            self.after_warmup = CompileCounts.now()
            return None
        self.done = True
        warm, later = self.after_warmup - self.start, CompileCounts.now() - self.after_warmup
        self.counts = {"warmup_graphs": warm.graphs, "warmup_graph_breaks": warm.graph_breaks,
                       "later_graph_breaks": later.graph_breaks, "recompilations": later.frames}
        line = (f"compile: {self.num_layers} layer(s) compiled; warm-up: {warm.graphs} graph(s), "
                f"{warm.graph_breaks} graph break(s); the step after it: {later.graph_breaks} graph break(s), "
                f"{later.frames} recompilation(s)")
        reasons = break_reasons()
        return line + (f" (breaks: {reasons})" if reasons and (warm.graph_breaks or later.graph_breaks) else "")
