"""The training loop lets the synchronizer compose the inner step and calls every hook at
its documented point, for any registered algorithm, without knowing which algorithm it
is: the parts of the step in order, unit hooks with their micro-batch and in training
only (never in evaluation), quiesce() before every evaluation, checkpoint save and exit;
and a step that ended training inside the synchronizer (StepResult.ended: an elastic site
healed to the job's final state) stops the loop there, through the protocol."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from megatron_lsgd.core.lsgd.membership import Heal
from megatron_lsgd.core.lsgd.protocol import Synchronizer
from megatron_lsgd.core.lsgd.registry import register, registered_algorithms
from tests.unit_tests.harness import free_port, spawn

PARTS = ("zero_grads", "compute_grads", "reduce_in_site", "apply")


class _RecordingStep:
    """Forwards to the real InnerStep, recording each part as it is called."""

    def __init__(self, step, events):
        self._step, self._events = step, events

    def __getattr__(self, name):
        attr = getattr(self._step, name)
        if name not in PARTS:
            return attr

        def part(*args, **kwargs):
            self._events.append(("part", name))
            return attr(*args, **kwargs)
        return part


if "recording" not in registered_algorithms():
    @register
    class RecordingSynchronizer(Synchronizer):
        """Records every hook (tests only)"""

        name = "recording"
        uses_unit_forward_hooks = True
        uses_unit_backward_hooks = True

        def __init__(self, ctx):
            super().__init__(ctx)
            self.events = []

        def train_step(self, step, data_iterator, iteration):
            self.events.append(("step", iteration))
            return super().train_step(_RecordingStep(step, self.events), data_iterator, iteration)

        def before_forward_backward(self, iteration):
            self.events.append(("before_fb", iteration))

        def before_unit_forward(self, unit, microbatch):
            self.events.append(("unit_fwd", unit.name, microbatch.index, microbatch.count))

        def after_unit_backward(self, unit, microbatch):
            # the unit's gradient for the step is complete when this fires
            grads_ready = all(p.main_grad.abs().sum() > 0 for p in unit.parameters() if p.ndim > 1)
            self.events.append(("unit_bwd", unit.name, grads_ready, microbatch.last))

        def after_forward_backward(self, iteration):
            self.events.append(("after_fb", iteration))

        def after_optimizer_step(self, iteration, ok):
            self.events.append(("after_opt", iteration, ok))

        def quiesce(self):
            self.events.append(("quiesce",))

        def finish_training(self, iteration):
            self.events.append(("finish", iteration))


if "recording-healed" not in registered_algorithms():
    @register
    class HealedRecordingSynchronizer(RecordingSynchronizer):
        """Records every hook; its membership reports, at the start of step 2, the heal that
        ended this site's training (what an elastic membership's quorum does) (tests only)"""

        name = "recording-healed"

        def before_forward_backward(self, iteration):
            super().before_forward_backward(iteration)
            if iteration == 2:
                self.ctx.membership.ended_by = Heal(committed_round=5, final=True)


def _worker(rank, world, port, out_dir, algorithm="recording", iters=2, pp=2):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import pretrain_gpt

    result = pretrain_gpt.main(["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2",
                                "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "3",
                                "--train-iters", str(iters), "--lr", "1e-3", "--mock-data", "--vocab-size", "64",
                                "--eval-interval", "1", "--eval-iters", "2", "--log-interval", "1",
                                "--save", os.path.join(out_dir, "ckpt"), "--save-interval", "2",
                                "--pipeline-model-parallel-size", str(pp), "--lsgd-algorithm", algorithm])
    torch.save({"events": result.synchronizer.events, "iteration": result.iteration},
               os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_hooks_fire_in_documented_order_on_each_pipeline_stage():
    with tempfile.TemporaryDirectory() as d:
        spawn(_worker, args=(2, free_port(), d), nprocs=2)
        events = [torch.load(os.path.join(d, f"{r}.pt"), weights_only=False)["events"] for r in range(2)]
    stage_units = [["embedding", "layers.0", "layers.1"], ["layers.2", "layers.3", "output"]]
    for rank, ev in enumerate(events):
        starts = [i for i, e in enumerate(ev) if e[0] == "step"]
        assert [ev[i] for i in starts] == [("step", 0), ("step", 1)]
        # between and after the steps: evaluation (quiesced first, no unit hook), the end
        assert ev[:starts[0]] == []
        assert ev[starts[1] - 1:starts[1]] == [("quiesce",)]  # evaluation at iteration 1
        tail = ev[ev.index(("after_opt", 1, True)) + 1:]
        # iteration 2 ends training: finish, then quiesce before evaluation, before the save, at exit
        assert tail == [("finish", 2), ("quiesce",), ("quiesce",), ("quiesce",)]
        for s, start in enumerate(starts):
            step = ev[start + 1:ev.index(("after_opt", s, True)) + 1]
            kinds = [e[0] for e in step]
            outline = [e[1] if e[0] == "part" else e[0] for e in step if e[0] not in ("unit_fwd", "unit_bwd")]
            assert outline == ["zero_grads", "before_fb", "compute_grads", "reduce_in_site", "after_fb", "apply",
                               "after_opt"]
            compute, reduce = step.index(("part", "compute_grads")), step.index(("part", "reduce_in_site"))
            units = [i for i, k in enumerate(kinds) if k in ("unit_fwd", "unit_bwd")]
            assert compute < min(units) and max(units) < reduce, "unit hooks fire inside compute_grads"
            fwd = [(e[1], e[2], e[3]) for e in step if e[0] == "unit_fwd"]
            # three micro-batches, units in forward order, each hook knowing its micro-batch
            assert fwd == [(u, mb, 3) for mb in range(3) for u in stage_units[rank]]
            bwd = [e for e in step if e[0] == "unit_bwd"]
            assert sorted(e[1] for e in bwd) == sorted(stage_units[rank])  # once per step each
            assert all(e[2] for e in bwd), "a unit was reported done before its gradient was complete"
            assert all(e[3] for e in bwd), "after_unit_backward fires on the last micro-batch"


@pytest.mark.slow
def test_a_step_that_ended_training_stops_the_loop_through_the_protocol():
    # The synchronizer's membership ends training at the start of step 2 of 4 (an elastic
    # site healed to the job's final state): train_step returns StepResult.ended without
    # computing, the loop takes no further step and does not call finish_training (the state
    # is final), and the run ends as usual (quiesce, the last save). Once an exception
    # (JobFinished) the Trainer caught; now the protocol's own path (issue 49).
    with tempfile.TemporaryDirectory() as d:
        spawn(_worker, args=(1, free_port(), d, "recording-healed", 4, 1), nprocs=1)
        saved = torch.load(os.path.join(d, "0.pt"), weights_only=False)
        checkpoints = sorted(os.listdir(os.path.join(d, "ckpt")))
    ev = saved["events"]
    assert saved["iteration"] == 2  # steps 0 and 1 taken, step 2 not
    assert [e for e in ev if e[0] == "step"] == [("step", 0), ("step", 1), ("step", 2)]
    ended = ev[ev.index(("step", 2)):]
    assert ended[:3] == [("step", 2), ("part", "zero_grads"), ("before_fb", 2)]
    assert ("part", "compute_grads") not in ended and ("after_opt", 2, True) not in ended
    assert not any(e[0] == "finish" for e in ev)  # finish_training is not called again
    assert ended[3:] == [("quiesce",)]  # the run's end: quiesced once (its last save: iteration 2, already saved)
    assert "iter_0000002" in checkpoints
