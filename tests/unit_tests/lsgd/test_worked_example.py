"""The worked example of docs/algorithms/adding-an-algorithm.md, run exactly as printed
there: it registers, its flags validate, and it trains like diloco with outer lr 1 and
momentum 0 (averaging the parameters every H steps) on ZeRO-1 with 2 sites."""

from __future__ import annotations

import os
import re
import sys
import types

import pytest
import torch

from tests.unit_tests import harness
from tests.unit_tests.lsgd.test_algorithms import COMMON, LAYOUTS, SGD, assert_close_runs
from tests.unit_tests.harness import spawn

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "algorithms", "adding-an-algorithm.md")


def example_source() -> str:
    with open(DOC) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert len(blocks) == 1, "the guide holds exactly one python block: the example"
    return blocks[0]


def register_example() -> None:
    from megatron_lsgd.core.lsgd.registry import registered_algorithms

    if "local-avg" not in registered_algorithms():  # as its own module, like a file in core/lsgd/algorithms would be
        module = types.ModuleType("local_avg_example")
        sys.modules[module.__name__] = module
        exec(compile(example_source(), DOC, "exec", dont_inherit=True), module.__dict__)


def _worker(rank, world, port, argv, out_dir):
    register_example()
    harness._worker(rank, world, port, argv, out_dir)


def run_with_example(argv, world):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        spawn(_worker, args=(world, harness.free_port(), argv, d), nprocs=world)
        return [torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def test_example_options_validate_by_flag():
    register_example()
    from megatron_lsgd.training.arguments import build_config, parse_args

    base = COMMON + ["--num-sites", "2", "--lsgd-algorithm", "local-avg"]
    with pytest.raises(ValueError, match=re.escape("--local-avg-every must be >= 1 (got 0)")):
        build_config(parse_args(base + ["--local-avg-every", "0"]), 2)
    with pytest.raises(ValueError, match="--local-avg-every needs --lsgd-algorithm local-avg"):
        build_config(parse_args(COMMON + ["--num-sites", "2", "--local-avg-every", "3"]), 2)
    assert build_config(parse_args(base + ["--local-avg-every", "3"]), 2).lsgd.algo.every == 3


@pytest.mark.slow
def test_example_equals_diloco_with_plain_averaging():
    world, layout = LAYOUTS["zero1-sites2"]
    argv = COMMON + SGD + layout + ["--train-iters", "7"]
    example = run_with_example(argv + ["--lsgd-algorithm", "local-avg", "--local-avg-every", "3"], world)
    diloco = harness.run_distributed(argv + ["--lsgd-algorithm", "diloco", "--lsgd-interval", "3",
                                             "--lsgd-outer-lr", "1", "--lsgd-outer-momentum", "0"], world)
    assert example[-1]["sync_stats"]["averages"] == 3  # after steps 3 and 6, and the partial last period
    assert_close_runs(example, diloco)
    harness.assert_replicas_identical(example)
