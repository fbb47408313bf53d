"""Outer-optimizer schedules (momentum warm-up, lr and momentum decay), by hand-computed
values: the schedule itself, and the anchor an OuterState reaches with it."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_lsgd.core.lsgd.config import OuterOptions
from megatron_lsgd.core.lsgd.outer_state import OuterState


def test_default_schedule_is_constant():
    opts = OuterOptions(lr=0.7, momentum=0.9)
    assert all(opts.at(k) == (0.7, 0.9) for k in (1, 2, 50, 10_000))


def test_warmup_then_linear_and_cosine_decay():
    opts = OuterOptions(lr=0.8, momentum=0.9, momentum_warmup=4, decay_start=6, decay_steps=4, min_lr=0.2,
                        momentum_final=0.5)
    expected_momentum = [0.225, 0.45, 0.675, 0.9, 0.9, 0.9, 0.8, 0.7, 0.6, 0.5, 0.5]
    expected_lr = [0.8] * 6 + [0.65, 0.5, 0.35, 0.2, 0.2]
    for k, (lr, mom) in enumerate(zip(expected_lr, expected_momentum), start=1):
        got = opts.at(k)
        assert got == pytest.approx((lr, mom), abs=1e-12), k
    cos = OuterOptions(lr=1.0, momentum=0.8, decay_start=2, decay_steps=4, decay_style="cosine", min_lr=0.0,
                       momentum_final=0.0)
    assert cos.at(2) == (1.0, 0.8)
    assert cos.at(4) == pytest.approx((0.5, 0.4))  # half way: (1 + cos(pi/2)) / 2
    assert cos.at(3) == pytest.approx((0.5 * (1 + math.cos(math.pi / 4)), 0.4 * (1 + math.cos(math.pi / 4))))
    assert cos.at(6) == pytest.approx((0.0, 0.0), abs=1e-12) and cos.at(9) == pytest.approx((0.0, 0.0), abs=1e-12)


class OneFragment:
    """The whole of a one-value shard, as ShardViews presents it to OuterState."""

    def __init__(self, main):
        self.key = self.fragment = "all"
        self.main = [main]

    def select(self, tensors):
        return [tensors[0]]


def test_outer_state_steps_with_the_scheduled_lr_and_momentum():
    main = torch.zeros(1, dtype=torch.float64)
    opts = OuterOptions(lr=0.5, momentum=0.8, momentum_warmup=2, decay_start=2, decay_steps=2, min_lr=0.1,
                        momentum_final=0.0)
    outer = OuterState([main.float()], opts)
    views = OneFragment(main.float())
    grads = [1.0, 2.0, -1.0, 4.0]
    # Hand-computed Nesterov SGD (torch's: first buffer = grad; buf = m buf + g; step g + m buf):
    # k=1: lr .5, m .4: buf 1,            step 1 + .4*1 = 1.4       anchor -0.7
    # k=2: lr .5, m .8: buf .8*1+2 = 2.8, step 2 + .8*2.8 = 4.24    anchor -0.7 - 2.12 = -2.82
    # k=3: lr .3, m .4: buf .4*2.8-1 = .12, step -1 + .4*.12 = -.952 anchor -2.82 + .2856 = -2.5344
    # k=4: lr .1, m 0:  plain SGD, step 4                          anchor -2.5344 - .4 = -2.9344
    expected = [-0.7, -2.82, -2.5344, -2.9344]
    for g, want in zip(grads, expected):
        outer.step(views, [torch.tensor([g])])
        assert outer.anchors[0].item() == pytest.approx(want, abs=1e-6)
    assert outer.steps == {"all": 4}
    saved = outer.state_dict()
    again = OuterState([main.float()], opts)
    again.load_state_dict(saved)
    assert again.steps == {"all": 4}


def test_default_outer_step_averages_the_sites_models(capsys):
    """The measured defaults (docs/quality.md): lr 1, no momentum, no buffer kept; the anchor
    becomes the sites' mean model. A checkpoint with outer momentum loaded into such a run
    says that the momentum is left unused."""
    opts = OuterOptions()
    assert (opts.lr, opts.momentum) == (1.0, 0.0)
    anchor = torch.tensor([1.0, -2.0])
    outer = OuterState([anchor.clone()], opts)
    assert outer.momenta == []
    site_models = [torch.tensor([0.5, -1.0]), torch.tensor([1.25, -3.5])]
    mean_pseudo_gradient = torch.stack([anchor - m for m in site_models]).mean(0)
    outer.step(OneFragment(anchor.clone()), [mean_pseudo_gradient])
    assert torch.equal(outer.anchors[0], torch.stack(site_models).mean(0))

    with_momentum = OuterState([anchor.clone()], OuterOptions(lr=0.7, momentum=0.9))
    with_momentum.step(OneFragment(anchor.clone()), [mean_pseudo_gradient])
    outer.load_state_dict(with_momentum.state_dict())
    assert "the checkpoint holds outer momentum, which this run does not use" in capsys.readouterr().out
    assert torch.equal(outer.anchors[0], with_momentum.anchors[0])
    OuterState([anchor.clone()], opts).load_state_dict(OuterState([anchor.clone()], opts).state_dict())
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("flags,message", [
    (dict(momentum_warmup=-1), "--lsgd-outer-momentum-warmup"),
    (dict(momentum=0.0, momentum_warmup=3), "--lsgd-outer-momentum-warmup needs"),
    (dict(decay_start=5, decay_steps=0), "--lsgd-outer-decay-steps"),
    (dict(decay_start=5, min_lr=1.5), "--lsgd-outer-min-lr"),
    (dict(momentum=0.9, decay_start=5, momentum_final=0.95), "--lsgd-outer-momentum-final"),
    (dict(min_lr=0.1), "--lsgd-outer-min-lr needs --lsgd-outer-decay-start"),
])
def test_bad_schedules_name_the_flag(flags, message):
    with pytest.raises(ValueError, match=message):
        OuterOptions(**flags).validate()


def test_schedule_flags_reach_the_outer_options():
    from tests.unit_tests.lsgd.test_config import config

    cfg = config(["--num-sites", "2", "--lsgd-algorithm", "streaming-diloco", "--lsgd-outer-momentum", "0.9",
                  "--lsgd-outer-momentum-warmup", "3",
                  "--lsgd-outer-decay-start", "10", "--lsgd-outer-decay-steps", "5", "--lsgd-outer-decay-style",
                  "cosine", "--lsgd-outer-min-lr", "0.1", "--lsgd-outer-momentum-final", "0.5"]).lsgd
    o = cfg.outer
    assert (o.momentum_warmup, o.decay_start, o.decay_steps, o.decay_style, o.min_lr, o.momentum_final) == \
        (3, 10, 5, "cosine", 0.1, 0.5)
    with pytest.raises(ValueError, match="--lsgd-outer-decay-steps needs --lsgd-outer-decay-start"):
        config(["--num-sites", "2", "--lsgd-algorithm", "diloco", "--lsgd-outer-decay-steps", "3"])
