import math

import pytest

from megatron_lsgd.core.optimizer.config import OptimizerConfig
from megatron_lsgd.core.optimizer.grad_scaler import DynamicGradScaler
from megatron_lsgd.core.optimizer.lr_scheduler import LRScheduler
from megatron_lsgd.training.data_samplers import SiteSampler


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


def _megatron_order(total, consumed, mb, dp_rank, dp):
    """Megatron's sampler: chunks of mb x DP, DP rank r takes the r-th micro-batch."""
    chunk = mb * dp
    return [list(range(s + dp_rank * mb, s + (dp_rank + 1) * mb)) for s in range(consumed, total - chunk + 1, chunk)]


@pytest.mark.parametrize("sites,dp_intra", [(1, 1), (1, 2), (2, 1), (2, 2), (3, 2)])
def test_sites_advancing_together_read_megatrons_order(sites, dp_intra):
    dp, mb, total = sites * dp_intra, 2, 100
    for consumed_steps in (0, 3):
        for site in range(sites):
            for r in range(dp_intra):
                got = list(SiteSampler(total, consumed_steps * mb * dp_intra, mb, site, sites, r, dp_intra))
                assert got == _megatron_order(total, consumed_steps * mb * dp, mb, site * dp_intra + r, dp)


def test_sites_at_different_speeds_never_share_a_sample():
    # site 0 ran 7 micro-batch chunks, site 1 only 2: their next 5 draws are still disjoint
    fast = [i for b in list(SiteSampler(64, 7 * 2, 2, 0, 2, 0, 1))[:5] for i in b]
    slow = [i for b in list(SiteSampler(64, 2 * 2, 2, 1, 2, 0, 1))[:5] for i in b]
    assert not set(fast) & set(slow)
    seen = [i for b in SiteSampler(64, 0, 2, 0, 2, 0, 1) for i in b] + [i for b in SiteSampler(64, 0, 2, 1, 2, 0, 1)
                                                                       for i in b]
    assert sorted(seen) == list(range(64))  # together the two streams cover the data once


def test_sampler_resumes_from_its_site_position():
    assert list(SiteSampler(16, 8, 2, 0, 1, 1, 2)) == [[10, 11], [14, 15]]
    with pytest.raises(ValueError, match="consumed samples"):
        SiteSampler(4, 8, 1, 0, 1, 0, 1)
    with pytest.raises(ValueError, match="not a multiple"):
        SiteSampler(16, 3, 2, 0, 1, 0, 1)


def test_sum_of_squares_reads_back_once_with_the_per_span_arithmetic(monkeypatch):
    import torch

    from megatron_lsgd.core.optimizer.shard_views import sum_of_squares

    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(1000, generator=gen) * 10 ** k for k in range(-3, 3)]
    spans = [(r, lo, lo + 37 * (r + 1)) for r in range(len(tensors)) for lo in (0, 200, 551)]
    expected = 0.0  # the per-span version: one read back (a device sync on a GPU) per span
    for r, lo, hi in spans:
        expected += float(torch.linalg.vector_norm(tensors[r][lo:hi], dtype=torch.float64)) ** 2
    reads = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or real_tolist(self))
    monkeypatch.setattr(torch.Tensor, "__float__", lambda self: pytest.fail("a per-span read back"))
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("a per-span read back"))
    assert sum_of_squares(tensors, spans) == expected and len(reads) == 1  # bit for bit
    assert sum_of_squares(tensors, []) == 0.0


def test_a_trial_restores_the_optimizer_state_into_the_tensors_it_had():
    """ACCO's trial step runs on the worker's CUDA stream: restoring the state must not drop
    tensors another stream allocated (a checkpoint load), only write into them."""
    import types

    import torch

    from megatron_lsgd.core.optimizer.sharded_optimizer import ShardedOptimizer

    a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(3))
    adam = torch.optim.AdamW([a], lr=0.1)
    a.grad = torch.full_like(a, 0.5)
    adam.step()  # a has state (loaded from a checkpoint, say); b has none yet
    adam.add_param_group({"params": [b]})
    before = {k: v for k, v in adam.state[a].items()}
    saved = {p: {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()} for p, st in adam.state.items()}
    b.grad = torch.full_like(b, 0.25)
    adam.step()  # the trial: moves a's state, creates b's
    ShardedOptimizer._restore_state(types.SimpleNamespace(optimizer=adam), saved)
    assert b not in adam.state and set(adam.state[a]) == set(before)
    for k, v in adam.state[a].items():
        assert v is before[k] and torch.equal(v, saved[a][k]), k  # the same tensors, the saved values


def test_adamw_runs_foreach_on_the_cpu_and_a_loaded_state_keeps_this_runs_kernel():
    from types import SimpleNamespace

    import torch

    from megatron_lsgd.core.optimizer.sharded_optimizer import ShardedOptimizer, _adamw_kernel

    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    assert _adamw_kernel([{"params": params}]) == {"foreach": True}  # CPU numerics: tests/regression
    # a checkpoint saved by a run whose kernel was fused (a GPU run) ...
    saved_by = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], fused=True)
    for p in saved_by.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    saved_by.step()
    # ... resumes on this run's kernel, with the saved moments
    here = torch.optim.AdamW(params, **_adamw_kernel([{"params": params}]))
    ShardedOptimizer._load_torch_state(SimpleNamespace(optimizer=here), saved_by.state_dict())
    group = here.param_groups[0]
    assert group["foreach"] is True and not group["fused"]
    assert torch.equal(here.state[params[0]]["exp_avg"], saved_by.state[saved_by.param_groups[0]["params"][0]]["exp_avg"])


def test_adam_kernel_forces_fused_on_the_cpu_within_a_few_ulps_of_foreach():
    """--adam-kernel fused (the planner's pilots) runs the fused kernel on the CPU; its values
    stay within float rounding of foreach's, which the default keeps for CPU runs."""
    import torch

    from megatron_lsgd.core.optimizer.sharded_optimizer import _adamw_kernel

    torch.manual_seed(0)
    values = [torch.randn(65, 33), torch.randn(33)]
    grads = [torch.randn_like(v) for v in values]
    assert _adamw_kernel([{"params": values}], "fused") == {"fused": True}
    assert _adamw_kernel([{"params": values}], "foreach") == {"foreach": True}
    out = {}
    for choice in ("auto", "fused"):
        params = [torch.nn.Parameter(v.clone()) for v in values]
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **_adamw_kernel([{"params": params}], choice))
        for _ in range(3):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
        out[choice] = (opt.param_groups[0]["fused"], params)
    assert out["fused"][0] and not out["auto"][0]
    for a, b in zip(out["fused"][1], out["auto"][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
