"""The Trainer stays narrow (issue 51): the training loops work on the run's Position and
the collaborators named in their constructors, never on the Trainer itself, and the one
lockstep decision is the Trainer's choice of loop. On fakes, each loop logs, evaluates,
saves and stops where its rule says."""

from __future__ import annotations

import ast
import inspect
from dataclasses import fields
from types import SimpleNamespace

import torch

import megatron_lsgd.training.lockstep_loop as lockstep_loop
import megatron_lsgd.training.meeting_loop as meeting_loop
from megatron_lsgd.core.clock import Clock
from megatron_lsgd.core.lsgd.protocol import Meeting, Stop, stop_at_meeting
from megatron_lsgd.training.lockstep_loop import LockstepLoop
from megatron_lsgd.training.meeting_loop import MeetingLoop
from megatron_lsgd.training.run_state import Position, Taken

LOOPS = (lockstep_loop, meeting_loop)


def _names(module) -> set:
    """Every identifier and attribute name the module's code uses."""
    tree = ast.parse(inspect.getsource(module))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def test_the_loops_never_reach_the_trainer():
    for module in LOOPS:
        used = _names(module)
        assert not used & {"trainer", "tr"}, f"{module.__name__} reaches the Trainer"


def test_lockstep_is_decided_once_by_the_trainer():
    """The Trainer picks the loop from `synchronizer.lockstep`, once; termination and the
    checkpointer ask the loop (its stop rule, `resumes_ended`) instead of branching on it."""
    import megatron_lsgd.training.checkpointing.checkpointer as checkpointer
    import megatron_lsgd.training.termination as termination
    import megatron_lsgd.training.training as training
    for module in (termination, checkpointer):
        assert "lockstep" not in _names(module), f"{module.__name__} branches on lockstep"
    reads = [n for n in ast.walk(ast.parse(inspect.getsource(training)))
             if isinstance(n, ast.Attribute) and n.attr == "lockstep"]
    assert len(reads) == 1


# ---- the loops on fakes: nothing but their Position and named collaborators ----------------

def _config(**training):
    t = dict(train_iters=7, log_interval=3, eval_interval=4, exit_interval=None, exit_duration_in_mins=None,
             train_samples=None, global_batch_size=4)
    t.update(training)
    return SimpleNamespace(training=SimpleNamespace(**t), checkpoint=SimpleNamespace(save_interval=2),
                           dims=SimpleNamespace(dp=4, sites=2, world_size=2), lsgd=SimpleNamespace(algorithm="fake"))


class _Calls:
    """The Trainer's three shared parts, recorded: a step of `site_samples` per step."""

    def __init__(self, loop, site_samples: int):
        self.loop, self.site_samples = loop, site_samples
        self.logged, self.acted = [], []
        self.run = SimpleNamespace(acc=SimpleNamespace(gbs=0))  # what the loop sets of Run: the step's global batch

    def step(self, run):
        pos = self.loop.position
        pos.iteration += 1
        pos.site_consumed_samples += self.site_samples
        return Taken(self.site_samples, same_on_every_site=True)

    def log(self, run):
        self.logged.append(self.loop.position.iteration)

    def act(self, run, stop, eval_due, save_due):
        self.acted.append((self.loop.position.iteration, stop, eval_due, save_due))
        return stop is not None


def _lockstep(config):
    pgs = SimpleNamespace(dp_intra_size=2, is_last_stage=True, rank=0, site_rank=0)
    return LockstepLoop(config, pgs, Position(), membership=None, device=torch.device("cpu"), line_rank=1,
                        clock=Clock())


def test_the_lockstep_loop_logs_evaluates_saves_and_stops_at_step_counts():
    loop = _lockstep(_config())
    calls = _Calls(loop, site_samples=2)
    loop.run(calls.run, calls.step, calls.log, calls.act)
    assert calls.logged == [3, 6, 7]  # every --log-interval and the last step
    assert [(it, ev, sv) for it, _, ev, sv in calls.acted] == [(i, i % 4 == 0, i % 2 == 0) for i in range(1, 8)]
    assert [stop for _, stop, _, _ in calls.acted] == [None] * 6 + [Stop(True, "--train-iters 7")]
    # the job advances by every site's samples: 2 per site's rank x dp 4 / dp_intra 2
    assert loop.position.consumed_samples == 7 * 4 and loop.checkpoint_iteration == 7 and calls.run.acc.gbs == 4


def test_the_lockstep_loop_pauses_at_the_exit_interval():
    loop = _lockstep(_config(exit_interval=5))
    calls = _Calls(loop, site_samples=2)
    loop.run(calls.run, calls.step, calls.log, calls.act)
    assert calls.acted[-1][:2] == (5, Stop(False, "--exit-interval 5")) and loop.position.iteration == 5


class _MeetingSynchronizer:
    """Site 0 of two; the other site takes 3 steps to this one's 2, and they meet every 2 of
    this site's steps; the stop rule is the shared one (protocol.stop_at_meeting)."""

    def __init__(self, position):
        self.position, self.held = position, None

    def agree_to_stop(self, progress):
        it = self.position.iteration
        self.held = Meeting(site_iterations=(it, it * 3 // 2), site_samples=(2 * it, 3 * it), synced=True) \
            if it % 2 == 0 else None
        return stop_at_meeting(self.held, progress) if self.held is not None else None

    def meeting(self):
        return self.held


def _meeting(config, position):
    pgs = SimpleNamespace(dp_intra_size=1, is_last_stage=True, rank=0, site_rank=0)
    scheduler = SimpleNamespace(num_steps=0, by_samples=False)
    return MeetingLoop(config, pgs, position, _MeetingSynchronizer(position), scheduler, clock=Clock())


def test_the_meeting_loop_acts_only_at_meetings_on_the_jobs_progress(capsys):
    # a budget of 5 global batches (20 samples): met after steps 2 (10 samples) and 4 (20)
    position = Position()
    loop = _meeting(_config(train_iters=5, eval_interval=3), position)
    calls = _Calls(loop, site_samples=2)
    loop.run(calls.run, calls.step, calls.log, calls.act)
    assert [(it, ev, sv) for it, _, ev, sv in calls.acted] == [(1, False, False), (2, False, True),
                                                               (3, False, False), (4, True, True)]
    assert calls.acted[-1][1] == Stop(True, "--train-iters budget of 20 samples reached (20 consumed, site "
                                            "steps 4/6)")
    assert calls.logged == [3, 4]  # every --log-interval of this site's steps, and the stop
    assert (position.agreed_iteration, position.consumed_samples, position.site_consumed_samples) == (5, 20, 8)
    assert loop.checkpoint_iteration == 5 and loop.scheduler.num_steps == 5  # the LR follows the job's progress
    assert calls.run.acc.gbs == 2 * 2  # as if every site had computed as many
    assert "training ends at iteration 4 of site 0 (--train-iters budget" in capsys.readouterr().out


def test_the_meeting_loop_pauses_at_the_first_meeting_past_the_exit_interval():
    loop = _meeting(_config(train_iters=100, exit_interval=2), Position())
    calls = _Calls(loop, site_samples=2)
    loop.run(calls.run, calls.step, calls.log, calls.act)
    assert calls.acted[-1][:2] == (2, Stop(False, "--exit-interval 2"))


def test_a_meeting_loop_whose_training_ended_takes_no_step():
    loop = _meeting(_config(), Position(ended=True))
    calls = _Calls(loop, site_samples=2)
    loop.run(calls.run, calls.step, calls.log, calls.act)
    assert loop.position.iteration == 0 and not calls.acted


def test_the_position_saves_and_restores_its_own_counters():
    saved = Position(iteration=9, consumed_samples=72, site_consumed_samples=36, agreed_iteration=8,
                     consumed_valid_samples=16, ended=True)
    state = saved.state_dict()
    # every counter but the job's agreed iteration and end, which a checkpoint keeps as its
    # name and metadata (and a heal takes from the step count)
    assert set(state) == {f.name for f in fields(Position)} - {"agreed_iteration", "ended"}
    held = Position()
    held.load_state_dict(state)
    assert held.state_dict() == state and (held.agreed_iteration, held.ended) == (0, False)
