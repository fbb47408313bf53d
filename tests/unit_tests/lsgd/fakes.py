"""A synchronizer context without a model or processes: a fake optimizer whose main
shards the test sets directly, and a one-site comm (collectives are local copies); and a
scripted torchft Manager under the real TorchftMembership round logic."""

from __future__ import annotations

from types import SimpleNamespace
from typing import List

import torch

from megatron_lsgd.core.clock import Clock
from megatron_lsgd.core.lsgd import catalog
from megatron_lsgd.core.lsgd.comm import InterSiteComm
from megatron_lsgd.core.lsgd.config import CompressionOptions, LsgdConfig, OuterOptions, RoundOptions
from megatron_lsgd.core.lsgd.fault_tolerance.torchft_membership import TorchftMembership
from megatron_lsgd.core.lsgd.outer_state import OuterState
from megatron_lsgd.core.lsgd.protocol import SyncContext
from megatron_lsgd.core.optimizer.shard_views import BucketExtent, PieceView, ShardRange, ShardViews
from megatron_lsgd.core.parallel_state import ParallelDims

_SHARED = {"interval": ("rounds", "interval"), "warmup_iters": ("rounds", "warmup_iters"),
           "outer_lr": ("outer", "lr"), "outer_momentum": ("outer", "momentum"), "outer_offload": ("outer", "offload"),
           "compression": ("compression", "kind"), "rank": ("compression", "rank"),
           "quant_block": ("compression", "quant_block"), "quantized_mean": ("compression", "quantized_mean")}


def lsgd_config(algorithm: str, num_sites: int = 2, **flat) -> LsgdConfig:
    """An LsgdConfig from flat keywords: shared knobs by the names above, anything else is
    a field of the algorithm's own Options. Validated like the command line's."""
    # Nesterov outer momentum unless a test says otherwise: the fakes exercise the momentum's
    # state (rollback, checkpoints, elastic rounds), which the run's default (plain averaging) has none of
    flat = {"outer_lr": 0.7, "outer_momentum": 0.9, **flat}
    groups = {"rounds": {}, "outer": {}, "compression": {}}
    own = {}
    for key, value in flat.items():
        if key in _SHARED:
            group, field_name = _SHARED[key]
            groups[group][field_name] = value
        else:
            own[key] = value
    cls = catalog.synchronizer_class(algorithm)
    cfg = LsgdConfig(algorithm=algorithm, rounds=RoundOptions(**groups["rounds"]),
                     outer=OuterOptions(**groups["outer"]), compression=CompressionOptions(**groups["compression"]),
                     algo=cls.Options(**own))
    catalog.validate(cfg, num_sites)
    return cfg


def whole_views(shards: List[torch.Tensor], layout=None) -> ShardViews:
    """The whole-model views of flat fake shards (what ShardedOptimizer.views() returns)."""
    layout = layout if layout is not None else [[((s.numel(),), 0, s.numel(), 0, s.numel())] for s in shards]
    ranges = [ShardRange(i, 0, s.numel()) for i, s in enumerate(shards)]
    pieces = [PieceView(f"p{i}.{j}", shape, p_lo, p_hi, i, lo, hi)
              for i, entries in enumerate(layout) for j, (shape, p_lo, p_hi, lo, hi) in enumerate(entries)]
    return ShardViews("all", ("*",), ranges, pieces, [s[0:s.numel()] for s in shards],
                      [torch.zeros_like(s) for s in shards], [BucketExtent(i, 0, s.numel()) for i, s in enumerate(shards)],
                      whole=True)


class FakeOptimizer:
    sharded = False  # one rank per site: nothing to split (SiteSplit)

    def __init__(self, shards: List[torch.Tensor], layout):
        self.shards = shards
        self._views = whole_views(shards, layout)
        self.copies = 0

    def main_param_shards(self):
        return self.shards

    def views(self, units=None):
        return self._views

    def copy_main_to_model_params(self, views=None):
        self.copies += 1


def one_rank_per_site_groups() -> SimpleNamespace:
    """The process groups a synchronizer reads, for one rank per site and no peers."""
    return SimpleNamespace(site=None, dims=ParallelDims(), dp_intra_rank=0, dp_intra=None, dp_intra_size=1,
                           inter_lanes=[])


def make_context(config: LsgdConfig, shards: List[torch.Tensor], layout=None) -> SyncContext:
    pgs = one_rank_per_site_groups()
    return SyncContext(pgs=pgs, config=config, models=[], optimizer=FakeOptimizer(shards, layout),
                       comm=InterSiteComm(None, 1))


def active(sync):
    """Force the local-SGD path on a one-site fake (the real loop disables it at S = 1)."""
    sync.active = True
    sync.outer = OuterState(sync.ctx.optimizer.main_param_shards(), sync.ctx.config.outer)
    return sync


class ScriptedManager:
    """The torchft Manager calls TorchftMembership makes, for one site alone: decision k
    (counting from 0) does not commit when k is in `fail`."""

    def __init__(self, fail=()):
        self.fail, self.decisions, self.step, self.quorums, self.error = set(fail), 0, 0, 0, None

    def start_quorum(self, timeout=None):
        self.quorums += 1
        self.error = None

    def num_participants(self):
        return 1

    def errored(self):
        return self.error

    def report_error(self, err):
        self.error = err

    def should_commit(self):
        k, self.decisions = self.decisions, self.decisions + 1
        ok = self.error is None and k not in self.fail
        self.step += ok
        return ok

    def current_step(self):
        return self.step

    def load_state_dict(self, state):
        self.step = int(state["step"])


def scripted_membership(fail=(), present=()) -> TorchftMembership:
    """TorchftMembership's round logic without torchft processes, over a ScriptedManager;
    `present`: the sites of the last quorum."""
    m = TorchftMembership.__new__(TorchftMembership)  # the round logic, no torchft processes
    m.manager, m.lines = ScriptedManager(fail), []
    m.options = SimpleNamespace(min_sites=1, max_wait_s=60.0, timeout_s=1.0, max_failed_rounds=0, lone_site="stop")
    m.comm = SimpleNamespace(set_sites=lambda group, n, sites=None: None, configured_sites=1, clock=Clock())
    m.order = list(present)
    m.site, m.present, m.pg, m.device, m.log, m.log_every, m.poll_s = 0, list(present), None, torch.device("cpu"), \
        m.lines.append, 60.0, 0.0
    m.rounds_attempted = m.rounds_committed = m.failed_in_a_row = 0
    m.alone = False
    m.heals, m.ended_by, m.joined, m._failed, m._failure, m._received, m._open = [], None, False, None, "", None, None
    m.finished = False
    m._digests, m._digested = None, -1
    m._trace = None
    return m
