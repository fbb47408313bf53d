"""Elastic dreamddp rounds without processes: the real DreamDDP synchronizer and the real
TorchftMembership round logic over a scripted torchft Manager (fakes.scripted_membership),
on a fake model of four units in one flat main shard and a comm whose mean halves (as if
the other site held zeros), so that every average moves the values it touches.

The multi-site job with real processes is test_fault_tolerance_pretrain.py's; here the
rounds are checked unit by unit: without failures the elastic rounds give the plain run's
numbers bit for bit; a round that does not commit puts every unit it averaged back to its
value just before that average; a failed collective is reported, not raised, and nothing
more is sent in its round; a schedule switch whose agreement failed is retried; the closing
average is retried until it commits.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from megatron_lsgd.core.clock import Clock
from megatron_lsgd.core.lsgd.algorithms.dreamddp.profile import Profile, UnitProfile
from megatron_lsgd.core.lsgd.algorithms.dreamddp.synchronizer import DreamDDP
from megatron_lsgd.core.lsgd.membership import Finished
from megatron_lsgd.core.lsgd.protocol import MicroBatch, SyncContext
from megatron_lsgd.core.optimizer.shard_views import BucketExtent, PieceView, ShardRange, ShardViews
from megatron_lsgd.core.parallel_state import ParallelDims
from tests.unit_tests.checkpointing.launch import assert_same
from tests.unit_tests.lsgd.fakes import lsgd_config, scripted_membership

UNITS = ["embedding", "layers.0", "layers.1", "output"]  # forward order
SIZE = 3  # values per unit
# With this profile, --lsgd-dreamddp-scheduler equal and no bubble filling, H = 2: slot 0
# averages {output, layers.1}, slot 1 {layers.0, embedding}.
SLOTS = [["output", "layers.1"], ["layers.0", "embedding"]]


class _Unit:
    def __init__(self, name: str):
        self.name, self._params, self.modules = name, [torch.nn.Parameter(torch.zeros(1))], [torch.nn.Identity()]

    def parameters(self):
        return iter(self._params)


class _Optimizer:
    """One flat main shard, each unit a range of it."""

    sharded = False

    def __init__(self):
        self.shard = torch.zeros(len(UNITS) * SIZE)
        self.grad = torch.zeros_like(self.shard)

    def main_param_shards(self):
        return [self.shard]

    def views(self, units=None):
        names = UNITS if units is None else [u.name for u in units]
        spans = [(UNITS.index(n) * SIZE, UNITS.index(n) * SIZE + SIZE) for n in names]
        return ShardViews("+".join(names), tuple(names), [ShardRange(0, lo, hi) for lo, hi in spans],
                          [PieceView(n, (SIZE,), 0, SIZE, i, 0, SIZE) for i, n in enumerate(names)],
                          [self.shard[lo:hi] for lo, hi in spans], [self.grad[lo:hi] for lo, hi in spans],
                          [BucketExtent(0, lo, hi) for lo, hi in spans], whole=units is None)

    def copy_main_to_model_params(self, views=None):
        pass


class _Comm:
    """Two sites, the other holding zeros: a mean halves. `fail_at`: the mean of that number
    (from 1) raises, as a collective whose peer died."""

    num_sites, exposed_seconds, rounds = 2, 0.0, 0

    def __init__(self, fail_at=0, fail_max=False):
        self.clock, self.means, self.fail_at, self.fail_max = Clock(), 0, fail_at, fail_max

    def use_dedicated_group(self, dims):
        return []

    def all_reduce_mean(self, tensor, async_op=False):
        self.means += 1
        if self.means == self.fail_at:
            raise RuntimeError("Connection closed by peer")
        tensor.mul_(0.5)
        return Finished(None)

    def all_reduce_max(self, tensor):
        if self.fail_max:
            self.fail_max = False
            raise RuntimeError("Connection closed by peer")

    @contextmanager
    def on_group(self, group):
        yield self


def _profile(tmp_path) -> str:
    path = tmp_path / "profile.json"
    units = [UnitProfile(n, 0, 1e-3, 0, 0) for n in UNITS]
    path.write_text(json.dumps({"profile": Profile(units, [0.0], 0.05, 1e-9, False).to_dict()}))
    return str(path)


def _dreamddp(tmp_path, membership=None, comm=None) -> DreamDDP:
    cfg = lsgd_config("dreamddp", interval=2, outer_lr=1.0, outer_momentum=0.0, profile=_profile(tmp_path),
                      scheduler="equal", no_bubble_fill=True)
    pgs = SimpleNamespace(site=None, dims=ParallelDims(), pp_rank=0, dp_intra_rank=0, dp_intra=None,
                          dp_intra_size=1, inter_lanes=[])
    ctx = SyncContext(pgs=pgs, config=cfg, models=[], optimizer=_Optimizer(), comm=comm or _Comm(),
                      units=[_Unit(n) for n in UNITS])
    if membership is not None:
        ctx.membership = membership
    return DreamDDP(ctx)


def _unit(sync, name: str) -> torch.Tensor:
    return sync.ctx.optimizer.views([sync.units[name]]).main[0]


def _steps(sync, first: int, count: int, seen=None):
    """Inner steps: every unit's backward completes (the synchronizer launches the slot's
    averages), then the local update adds 1 + iteration to every value. `seen[i]`: the
    shard just before step i's averages."""
    for i in range(first, first + count):
        sync.before_forward_backward(i)
        if seen is not None:
            seen[i] = sync.ctx.optimizer.shard.clone()
        for name in sync.names:
            sync.after_unit_backward(sync.units[name], MicroBatch(0, 1))
        sync.after_forward_backward(i)
        sync.ctx.optimizer.shard.add_(1.0 + i)
        sync.after_optimizer_step(i, True)


def test_the_equal_schedule_of_the_profile_is_the_one_this_file_expects(tmp_path):
    sync = _dreamddp(tmp_path)
    _steps(sync, 0, 2)
    assert [sorted(s) for s in sync.plan.stages[0].slots] == [sorted(s) for s in SLOTS]
    assert [sorted(units) for _, units in sync.history] == [sorted(s) for s in SLOTS]


def test_elastic_rounds_without_failures_equal_the_plain_run(tmp_path):
    plain, m = _dreamddp(tmp_path), scripted_membership()
    elastic = _dreamddp(tmp_path, m)
    for sync in (plain, elastic):
        _steps(sync, 0, 7)  # three whole rounds, then one step of a fourth
        sync.quiesce()  # (a checkpoint: the round under way is decided)
        _steps(sync, 7, 2)
        sync.finish_training(9)
    assert torch.equal(plain.ctx.optimizer.shard, elastic.ctx.optimizer.shard)
    assert_same(elastic.state_dict(), plain.state_dict())
    assert list(plain.history) == list(elastic.history)
    # rounds: steps 0-1, 2-3, 4-5, 6 (cut by the checkpoint), 7 (the rest of its period), 8 (cut by
    # the end), and the closing average: a quorum and a decision each
    assert m.manager.quorums == 7 and m.manager.decisions == 7 and m.rounds_committed == 7 and m._open is None
    assert elastic.undo.copies is None and plain.undo.copies is None  # nothing kept between rounds


def test_a_round_that_does_not_commit_puts_its_averaged_units_back(tmp_path):
    m = scripted_membership(fail={1})  # the second round (steps 2 and 3)
    sync = _dreamddp(tmp_path, m)
    seen = {}
    _steps(sync, 0, 4, seen)
    # slot 0's units were averaged in step 2, slot 1's in step 3: each is back at its value
    # just before its average (the local steps it took after it are gone with it)
    for slot, step in ((0, 2), (1, 3)):
        for name in SLOTS[slot]:
            i = UNITS.index(name) * SIZE
            assert torch.equal(_unit(sync, name), seen[step][i:i + SIZE]), name
    assert m.rounds_committed == 1 and m.manager.decisions == 2
    # when each unit was last averaged is back too: every unit is overdue in step 4 (slot 0)
    _steps(sync, 4, 1)
    assert sorted(sync.history[-1][1]) == sorted(UNITS)
    assert "round 2 was not committed (" in m.lines[0] and "a peer site did not commit" in m.lines[0], m.lines


def test_a_failed_average_is_reported_and_nothing_more_is_sent_in_its_round(tmp_path):
    # means 1-4: steps 0 and 1; mean 6 (step 2's second unit, layers.1) fails
    m, comm = scripted_membership(), _Comm(fail_at=6)
    sync = _dreamddp(tmp_path, m, comm)
    seen = {}
    _steps(sync, 0, 4, seen)  # no exception: reported to the Manager
    assert comm.means == 6  # step 3's averages were not sent
    assert m.rounds_committed == 1 and m.manager.decisions == 2
    for slot, step in ((0, 2), (1, 3)):  # averaged, failed, or never sent: every unit of the round back
        for name in SLOTS[slot]:
            i = UNITS.index(name) * SIZE
            assert torch.equal(_unit(sync, name), seen[step][i:i + SIZE]), name
    _steps(sync, 4, 2)
    assert "Connection closed by peer" in m.lines[0] and m.rounds_committed == 2


def test_a_switch_whose_agreement_fails_is_rolled_back_and_retried(tmp_path):
    # the profile file's agreement (step 0, inside the first round) fails: no schedule adopted,
    # the round rolls back, and the next round reads the file again
    m, comm = scripted_membership(), _Comm(fail_max=True)
    sync = _dreamddp(tmp_path, m, comm)
    _steps(sync, 0, 1)
    assert sync.profile is None and comm.means == 0  # the round failed before its first average
    _steps(sync, 1, 1)
    assert m.rounds_committed == 0 and m.manager.decisions == 1  # the round of steps 0-1
    _steps(sync, 2, 2)
    assert sync.profile is not None and sync.origin == 2 and m.rounds_committed == 1  # periods from the retry


@pytest.mark.parametrize("fail", [set(), {3}])
def test_the_closing_average_is_a_round_of_its_own_retried_until_it_commits(tmp_path, fail):
    m = scripted_membership(fail=fail)
    sync = _dreamddp(tmp_path, m)
    _steps(sync, 0, 6)
    before = sync.ctx.optimizer.shard.clone()
    sync.finish_training(6)
    assert torch.equal(sync.ctx.optimizer.shard, before * 0.5)  # averaged once, whatever was retried
    assert m.manager.decisions == 4 + len(fail) and not sync.final_due and not sync.finishing


def test_a_heal_carries_the_step_the_peer_starts_and_the_rounds(tmp_path):
    peer = _dreamddp(tmp_path, scripted_membership())
    _steps(peer, 0, 4)
    state = peer.state_dict()
    assert state["rounds"] == {"due": 1, "finishing": 0, "final_due": 0, "next_iteration": 4}
    healed = _dreamddp(tmp_path, scripted_membership())
    healed.load_state_dict(state)  # what torchft's heal calls at the quorum
    assert healed._healed_to == 4 and healed.due and healed.round is None
