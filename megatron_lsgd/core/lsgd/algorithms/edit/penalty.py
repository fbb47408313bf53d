"""EDiT's pseudo-gradient penalty (EDiT paper §3.2, Algorithm 2; DESIGN.md §4.4), as pure
arithmetic on the per-site norms of one sync unit.

Every rank of a dp_inter group holds the same vector G (one norm per site, each over the
unit's whole parameters, gathered across sites), so every rank reaches the same decision
without further messages. Three parts, each switchable (`--lsgd-edit-penalty`):

- anomaly elimination: an EMA z-test per (unit, site). z = (G - mu) / sigma with the
  statistics *before* this observation; z > delta flags the site (its G := inf) and its
  observation is kept out of the statistics. Non-finite norms are always flagged. The first
  `warmup` observations of a (unit, site) are never flagged and set mu and sigma^2 to their
  exact running mean and variance; from then on mu <- a G + (1 - a) mu and
  sigma^2 <- (1 - a) sigma^2 + a (G - mu_new)^2 (a = alpha). Our reading: the paper's EMA
  started from one observation would make sigma ~ sqrt(n a) times too small during its
  first 1/a observations and flag ordinary noise, which its warm-up is there to prevent.
- weighted averaging: w_i = softmax(-G_i) over the sites not flagged, computed as
  exp(-(G_i - min G)) / sum, so raw norms of hundreds do not underflow to "all flagged".
  Off: w_i = 1 / (number not flagged).
- clip: the averaged pseudo-gradient is scaled by min(phi / (||mean|| + eps), 1).

All sites flagged: roll the unit back to its anchor, no outer step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Sequence

PARTS = ("anomaly", "weighted", "clip")
CLIP_EPS = 1e-6


def parse_parts(text: str) -> frozenset:
    """'anomaly,weighted,clip' -> the parts; 'none' or '' -> no penalty."""
    items = [x.strip() for x in (text or "").split(",") if x.strip()]
    if items == ["none"]:
        return frozenset()
    bad = [x for x in items if x not in PARTS]
    if bad:
        raise ValueError(f"--lsgd-edit-penalty {text!r}: unknown part(s) {', '.join(bad)}; give a comma-separated "
                         f"subset of {', '.join(PARTS)}, or none")
    return frozenset(items)


def softmax_neg(norms: Sequence[float]) -> List[float]:
    """softmax(-G) over the finite entries (infinite or NaN entries get weight 0), computed
    relative to the smallest finite norm. All entries non-finite: all weights 0."""
    finite = [g for g in norms if math.isfinite(g)]
    if not finite:
        return [0.0] * len(norms)
    low = min(finite)
    exps = [math.exp(-(g - low)) if math.isfinite(g) else 0.0 for g in norms]
    total = sum(exps)  # >= 1: the smallest norm contributes exp(0)
    return [e / total for e in exps]


def clip_coefficient(norm: float, phi: float) -> float:
    return min(phi / (norm + CLIP_EPS), 1.0)


@dataclass
class SiteStats:
    """EMA statistics of one (unit, site)'s pseudo-gradient norm."""

    count: int = 0
    mean: float = 0.0
    var: float = 0.0

    def z_exceeds(self, g: float, delta: float) -> bool:
        # sigma = 0 (identical observations so far) flags anything measurably above the mean
        return g - self.mean > delta * math.sqrt(self.var) + 1e-6 * abs(self.mean)

    def update(self, g: float, alpha: float, warmup: int) -> None:
        self.count += 1
        if self.count <= max(warmup, 1):  # exact running mean / variance (Welford)
            delta = g - self.mean
            self.mean += delta / self.count
            self.var += (delta * (g - self.mean) - self.var) / self.count
            return
        self.mean = alpha * g + (1 - alpha) * self.mean
        self.var = (1 - alpha) * self.var + alpha * (g - self.mean) ** 2


@dataclass
class Decision:
    """What one unit's sync does: every site's weight (summing to 1 over the sites kept), who
    was flagged, and whether the unit rolls back to its anchor."""

    weights: List[float]
    flagged: List[bool]

    @property
    def rollback(self) -> bool:
        return all(self.flagged)

    def state(self) -> Dict:
        return {"weights": list(self.weights), "flagged": [int(f) for f in self.flagged]}

    @classmethod
    def from_state(cls, state: Dict) -> "Decision":
        return cls([float(w) for w in state["weights"]], [bool(f) for f in state["flagged"]])


@dataclass
class Penalty:
    """The penalty's configuration and its per-(unit, site) detector state."""

    parts: frozenset
    num_sites: int
    delta: float = 3.0
    alpha: float = 0.02
    warmup: int = 10
    phi: float = 10.0
    stats: Dict[str, List[SiteStats]] = field(default_factory=dict)

    @property
    def needs_norms(self) -> bool:
        return bool(self.parts & {"anomaly", "weighted"})

    @property
    def clips(self) -> bool:
        return "clip" in self.parts

    def decide(self, unit: str, norms: Sequence[float]) -> Decision:
        """Flag, weigh and (on the statistics) observe one unit's per-site norms."""
        n = self.num_sites
        if not self.needs_norms:
            return Decision([1.0 / n] * n, [False] * n)
        flagged = [not math.isfinite(g) for g in norms]
        if "anomaly" in self.parts:
            stats = self.stats.setdefault(unit, [SiteStats() for _ in range(n)])
            for i, g in enumerate(norms):
                if not flagged[i] and stats[i].count >= self.warmup and stats[i].z_exceeds(g, self.delta):
                    flagged[i] = True
            for i, g in enumerate(norms):
                if not flagged[i]:  # a flagged observation is kept out of the statistics
                    stats[i].update(g, self.alpha, self.warmup)
        if "weighted" in self.parts:
            weights = softmax_neg([math.inf if f else g for f, g in zip(flagged, norms)])
        else:
            kept = n - sum(flagged)
            weights = [0.0 if f else 1.0 / kept for f in flagged] if kept else [0.0] * n
        return Decision(weights, flagged)

    def state_dict(self) -> Dict:
        return {unit: {"count": [s.count for s in ss], "mean": [s.mean for s in ss], "var": [s.var for s in ss]}
                for unit, ss in sorted(self.stats.items())}

    def load_state_dict(self, state: Dict) -> None:
        self.stats = {unit: [SiteStats(int(c), float(m), float(v)) for c, m, v in zip(s["count"], s["mean"], s["var"])]
                      for unit, s in state.items()}
