"""The training loop calls every synchronizer hook at its documented point, for any
registered algorithm, without knowing which algorithm it is."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_lsgd.core.lsgd.base import Synchronizer, register, registered_algorithms
from tests.unit_tests.harness import free_port

if "recording" not in registered_algorithms():
    @register
    class RecordingSynchronizer(Synchronizer):
        name = "recording"
        uses_unit_forward_hooks = True
        uses_unit_backward_hooks = True

        def __init__(self, ctx):
            super().__init__(ctx)
            self.events = []

        def wrap_train_step(self, step_fn):
            self.events.append(("wrap",))

            def wrapped(it):
                self.events.append(("step",))
                return step_fn(it)
            return wrapped

        def before_forward_backward(self, iteration):
            self.events.append(("before_fb", iteration))

        def before_unit_forward(self, unit):
            self.events.append(("unit_fwd", unit.name))

        def after_unit_backward(self, unit):
            # the unit's gradient for the step is complete when this fires
            grads_ready = all(p.main_grad.abs().sum() > 0 for p in unit.parameters() if p.ndim > 1)
            self.events.append(("unit_bwd", unit.name, grads_ready))

        def after_forward_backward(self, iteration):
            self.events.append(("after_fb", iteration))

        def after_optimizer_step(self, iteration, ok):
            self.events.append(("after_opt", iteration, ok))

        def finish_training(self, iteration):
            self.events.append(("finish", iteration))


def _worker(rank, world, port, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import pretrain_gpt
    from megatron_lsgd.training import training

    captured = {}
    original = training.Trainer.__init__

    def spy(self, *a, **k):
        original(self, *a, **k)
        captured["sync"] = self.synchronizer

    training.Trainer.__init__ = spy
    pretrain_gpt.main(["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2",
                       "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "3",
                       "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--vocab-size", "64",
                       "--eval-iters", "0", "--log-interval", "1", "--pipeline-model-parallel-size", "2",
                       "--lsgd-algorithm", "recording"])
    torch.save(captured["sync"].events, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_hooks_fire_in_documented_order_on_each_pipeline_stage():
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(2, free_port(), d), nprocs=2)
        events = [torch.load(os.path.join(d, f"{r}.pt"), weights_only=False) for r in range(2)]
    stage_units = [["embedding", "layers.0", "layers.1"], ["layers.2", "layers.3", "output"]]
    for rank, ev in enumerate(events):
        assert ev[0] == ("wrap",)
        steps = [i for i, e in enumerate(ev) if e == ("step",)]
        assert len(steps) == 2
        assert ev[-1] == ("finish", 2) and sum(e[0] == "finish" for e in ev) == 1  # once, at --train-iters
        ev = ev[:-1]
        for s, start in enumerate(steps):
            end = steps[s + 1] if s + 1 < len(steps) else len(ev)
            step = ev[start + 1:end]
            kinds = [e[0] for e in step]
            assert kinds[0] == "before_fb" and step[0][1] == s
            assert kinds[-2:] == ["after_fb", "after_opt"]
            assert step[-1] == ("after_opt", s, True)
            fwd = [e[1] for e in step if e[0] == "unit_fwd"]
            assert fwd == stage_units[rank] * 3  # three micro-batches, units in forward order
            bwd = [e for e in step if e[0] == "unit_bwd"]
            assert sorted(e[1] for e in bwd) == sorted(stage_units[rank])  # once per step each
            assert all(e[2] for e in bwd), "a unit was reported done before its gradient was complete"
            assert kinds.index("after_fb") > max(i for i, k in enumerate(kinds) if k == "unit_bwd")
