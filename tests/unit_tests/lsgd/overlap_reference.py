"""A hand-computed reference for `acco` and `dpu`, run on one rank.

`hand-overlap-test` (registered here, for tests only) trains one rank, with no threads, no
double buffering and no parallelism, and writes the updates out by hand: AdamW (decoupled
weight decay, bias correction) and gradient clipping on the fp32 parameters, the estimate
step of acco on copies. It reads the micro-batches that each (site, data-parallel rank) of
the distributed run would read, from the one-rank stream (the i-th micro-batch of site s,
rank r is the one-rank micro-batch i x DP + s x DP_intra + r), and takes each gradient as
the mean over the union of every site's micro-batches of the stage: exactly the weighting
by micro-batch counts the distributed algorithms must implement.

    dpu:  g_k = grad at P_k over step k's micro-batches;  θ_{k+1} = AdamW(θ_k, g_k);  P_{k+1} = θ_k
          (P_0 = θ_0: the parameters one update old; P_{k+1} = θ_{k+1} in the warm-up, k < W)
    acco: g~_k = grad at θ~_k over the first n_s // 2 micro-batches of each site,
          θ~_{k+1} = AdamW(θ_k, g~_k) on copies (moments not committed),
          g_k = grad at θ_k over the other micro-batches,
          θ_{k+1} = AdamW(θ_k, (n~ g~_k + n g_k) / (n~ + n))            (θ~_0 = θ_0)

The logged loss of a step is what the distributed run logs: the mean over sites of each
site's mean micro-batch loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List

import torch

from megatron_lsgd.core.options import OptionGroup, option
from megatron_lsgd.core.lsgd.protocol import StepResult, Synchronizer
from megatron_lsgd.core.lsgd.registry import register, registered_algorithms

NAME = "hand-overlap-test"
MODULE = __name__  # harness.run_distributed_many(..., setup_module=MODULE) registers it in spawned ranks


@dataclass
class HandOptions(OptionGroup):
    algorithm: str = option("--hand-algorithm", "acco", "acco or dpu")
    dp_intra: int = option("--hand-dp-intra", 1, "data-parallel ranks per site of the distributed run")
    site_counts: str = option("--hand-site-counts", "2,2", "micro-batches per rank per step, per site")
    warmup: int = option("--hand-warmup", 0, "dpu: first steps whose gradient is taken at the newest θ")


class HandOverlap(Synchronizer):
    """Hand-computed acco/dpu on one rank (tests only)"""

    name = NAME
    Options = HandOptions

    def __init__(self, ctx):
        super().__init__(ctx)
        o = ctx.config.algo
        self.algo = o.algorithm
        self.counts = [int(x) for x in o.site_counts.split(",")]
        self.dp_intra = o.dp_intra
        self.dp = len(self.counts) * self.dp_intra
        self.warmup = o.warmup
        opt = ctx.optimizer
        self.cfg = opt.config
        self.pieces = [(pc.shard, pc.lo, pc.hi, pc.param.ndim > 1) for pc in opt.pieces]
        self.theta = [m.clone() for m in opt.main_param_shards()]
        self.prev = [t.clone() for t in self.theta]  # dpu: what the model computes at
        self.tilde = [t.clone() for t in self.theta]  # acco: θ~
        self.moments = ([torch.zeros_like(t) for t in self.theta], [torch.zeros_like(t) for t in self.theta], 0)
        self.cache: Dict[int, dict] = {}
        self.read = 0
        self.step_index = 0

    # ---- pieces ------------------------------------------------------------------------------
    def _batches(self, data_iterator, indices: List[int]) -> List[dict]:
        while any(j not in self.cache for j in indices):
            self.cache[self.read] = next(data_iterator)
            self.read += 1
        return [self.cache.pop(j) for j in indices]

    def _indices(self, site: int, lo: int, hi: int) -> List[int]:
        return [i * self.dp + site * self.dp_intra + r for i in range(lo, hi) for r in range(self.dp_intra)]

    def _load(self, theta) -> None:
        opt = self.ctx.optimizer
        for main, t in zip(opt.main_param_shards(), theta):
            main.copy_(t)
        opt.copy_main_to_model_params()

    def _grad(self, step, data_iterator, theta, indices):
        self._load(theta)
        step.zero_grads()
        losses = step.compute_grads(iter(self._batches(data_iterator, indices)), len(indices))
        step.reduce_in_site()
        return [g.clone() for g in self.ctx.optimizer.views().grad], [d["lm loss"].float() for d in losses]

    def _clipped(self, grads):
        clip = self.cfg.clip_grad
        norm = math.sqrt(sum(float(grads[s][lo:hi].double().pow(2).sum()) for s, lo, hi, _ in self.pieces))
        out = [g.clone() for g in grads]
        if clip > 0 and norm > clip:
            for g in out:
                g.mul_(clip / (norm + 1e-6))
        return out

    def _adamw(self, theta, grads, moments, lr):
        m, v, t = moments
        t += 1
        b1, b2, eps, wd = self.cfg.adam_beta1, self.cfg.adam_beta2, self.cfg.adam_eps, self.cfg.weight_decay
        theta, m, v = [x.clone() for x in theta], [x.clone() for x in m], [x.clone() for x in v]
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        for s, lo, hi, decay in self.pieces:
            p, g, mm, vv = theta[s][lo:hi], grads[s][lo:hi], m[s][lo:hi], v[s][lo:hi]
            if decay:
                p.mul_(1 - lr * wd)
            mm.mul_(b1).add_(g, alpha=1 - b1)
            vv.mul_(b2).addcmul_(g, g, value=1 - b2)
            p.addcdiv_(mm, (vv.sqrt() / math.sqrt(bc2)).add_(eps), value=-lr / bc1)
        return theta, (m, v, t)

    # ---- the step ------------------------------------------------------------------------------
    def train_step(self, step, data_iterator, iteration):
        k = self.step_index
        self.step_index += 1
        lr = step.scheduler.next_lr()
        per_site: List[List[torch.Tensor]] = [[] for _ in self.counts]
        if self.algo == "dpu":
            idx = [j for s, c in enumerate(self.counts) for j in self._indices(s, k * c, (k + 1) * c)]
            g, losses = self._grad(step, data_iterator, self.prev, idx)
            self.prev = self.theta
            self.theta, self.moments = self._adamw(self.theta, self._clipped(g), self.moments, lr)
            if k < self.warmup:  # the warm-up's steps are not delayed
                self.prev = self.theta
            groups = [(idx, losses)]
        else:
            est = [j for s, c in enumerate(self.counts) for j in self._indices(s, k * c, k * c + c // 2)]
            real = [j for s, c in enumerate(self.counts) for j in self._indices(s, k * c + c // 2, (k + 1) * c)]
            g_est, l_est = self._grad(step, data_iterator, self.tilde, est)
            tilde_next, _ = self._adamw(self.theta, self._clipped(g_est), self.moments, lr)
            g, l_real = self._grad(step, data_iterator, self.theta, real)
            comb = [(len(est) * a + len(real) * b) / (len(est) + len(real)) for a, b in zip(g_est, g)]
            self.theta, self.moments = self._adamw(self.theta, self._clipped(comb), self.moments, lr)
            self.tilde = tilde_next
            groups = [(est, l_est), (real, l_real)]
        step.scheduler.step()
        for idx, losses in groups:
            for j, loss in zip(idx, losses):
                per_site[(j % self.dp) // self.dp_intra].append(loss)
        logged = torch.stack([torch.stack(ls).mean() for ls in per_site]).mean()
        return StepResult([{"lm loss": logged}], True, None, sum(self.counts))

    def finish_training(self, iteration):
        self._load(self.theta)


if NAME not in registered_algorithms():
    register(HandOverlap)
