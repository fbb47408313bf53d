import math

import pytest

from megatron_lsgd.core.optimizer.config import OptimizerConfig
from megatron_lsgd.core.optimizer.grad_scaler import DynamicGradScaler
from megatron_lsgd.core.optimizer.lr_scheduler import LRScheduler
from megatron_lsgd.training.data_samplers import PretrainingSampler


def schedule(style, **kw):
    c = OptimizerConfig(lr=1.0, min_lr=0.1, lr_decay_style=style, lr_warmup_iters=10, **kw)
    c.validate(train_iters=110)
    return LRScheduler(c)


def test_warmup_is_linear_from_zero():
    s = schedule("cosine")
    assert s.lr_at(0) == 0.0 and s.lr_at(5) == pytest.approx(0.5) and s.lr_at(10) == pytest.approx(1.0)


@pytest.mark.parametrize("style,mid", [("linear", 0.55), ("cosine", 0.55), ("constant", 1.0)])
def test_decay_shapes(style, mid):
    s = schedule(style)
    assert s.lr_at(60) == pytest.approx(mid)
    assert s.lr_at(110) == pytest.approx(0.1 if style != "constant" else 1.0)
    assert s.lr_at(500) == pytest.approx(0.1 if style != "constant" else 1.0)


def test_cosine_quarter_point():
    s = schedule("cosine")
    assert s.lr_at(35) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))


def test_scheduler_state_round_trip():
    s = schedule("linear")
    for _ in range(7):
        s.step()
    t = schedule("linear")
    t.load_state_dict(s.state_dict())
    assert t.next_lr() == s.next_lr()


def test_dynamic_loss_scale_backoff_with_hysteresis_and_growth():
    g = DynamicGradScaler(initial_scale=1024, min_scale=1, growth_interval=3, hysteresis=2)
    g.update(True)
    assert g.scale == 1024  # first overflow absorbed by hysteresis
    g.update(True)
    assert g.scale == 512
    for _ in range(3):
        g.update(False)
    assert g.scale == 1024
    for _ in range(40):
        g.update(True)
    assert g.scale == 1  # never below min


def test_sampler_splits_each_chunk_by_dp_rank():
    batches = [list(PretrainingSampler(16, 0, 2, r, 2)) for r in range(2)]
    assert batches[0][:2] == [[0, 1], [4, 5]] and batches[1][:2] == [[2, 3], [6, 7]]
    union = sorted(i for r in batches for b in r for i in b)
    assert union == list(range(16))


def test_sampler_resumes_from_consumed_samples():
    assert list(PretrainingSampler(16, 8, 2, 1, 2)) == [[10, 11], [14, 15]]
    with pytest.raises(ValueError, match="consumed samples"):
        PretrainingSampler(4, 8, 1, 0, 1)
