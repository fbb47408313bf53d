"""The contract every algorithm the catalog registers keeps, run over the registry so that a
new algorithm is covered without a line here:

- it trains on two sites (finite losses, bytes across sites);
- paused at a checkpoint (--exit-interval) and resumed, it reproduces the uninterrupted run
  bit for bit: every rank's losses and weights, and the final checkpoint (optimizer,
  synchronizer and RNG state included);
- it refuses, with one `error:` line naming the flag and exit code 2, what its class
  declares it does not support (fault tolerance, sites of different sizes, one site, the
  shared option groups it does not use).

Each algorithm runs with its recipe's settings (tools/benchmarks/recipes.py, the one table of
per-algorithm settings) on the board's default scenario, whose simulated clock makes the
time-based ones (a-edit's intervals, acco's adaptive accumulation) deterministic. All
algorithms train in one spawned job of two ranks, one per site.
"""

from __future__ import annotations

import os
from typing import Dict, List

import pytest
import torch

from megatron_lsgd.core.lsgd import algorithms
from megatron_lsgd.core.lsgd.catalog import registered_algorithms, synchronizer_class
from megatron_lsgd.core.lsgd.config import SHARED_GROUPS
from megatron_lsgd.core.lsgd.protocol import Synchronizer
from megatron_lsgd.training.arguments import build_config, parse_args
from megatron_lsgd.training.scenario import load_scenario
from tests.unit_tests.checkpointing.launch import ROOT, TINY, assert_same, load_tree
from tests.unit_tests.checkpointing.single import run_single
from tests.unit_tests.harness import run_distributed_many
from tools.benchmarks import recipes

# The catalog's algorithms (a test may register one of its own in this process: not these).
ALGORITHMS = [n for n in registered_algorithms()
              if synchronizer_class(n).__module__.startswith(algorithms.__name__ + ".")]
SCENARIO = os.path.join(ROOT, "tools", "benchmarks", "scenarios", "emulated-default.toml")
INTERVAL = 4  # the least the streaming recipes allow (a fragment's delay of one step < H / 2 fragments)
ITERS, PAUSE = 6, 3


def settings(algorithm: str) -> List[str]:
    """The algorithm's flags: its recipe's recommended ones on the scenario, at INTERVAL."""
    return ["--lsgd-algorithm", algorithm] + recipes.recommended(algorithm, load_scenario(SCENARIO), INTERVAL)


def test_every_algorithm_has_settings():
    assert "sync" in ALGORITHMS, "the catalog discovered no algorithms"
    assert set(SHARED_PROBES) == set(SHARED_GROUPS), "a shared option group without its probe in SHARED_PROBES"
    for algorithm in ALGORITHMS:
        settings(algorithm)  # a new algorithm without a recipe: an error naming recipes.py


def _tracker(save_dir: str) -> str:
    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")) as f:
        return os.path.join(save_dir, f"iter_{int(f.read()):07d}")


@pytest.mark.slow
def test_every_algorithm_trains_and_resumes_bit_exactly(tmp_path):
    base = TINY + ["--num-sites", "2", "--train-iters", str(ITERS), "--save-interval", str(PAUSE),
                   "--simulate-scenario", SCENARIO]
    argvs: List[List[str]] = []
    dirs: Dict[str, tuple] = {}
    for algorithm in ALGORITHMS:
        ref, ckpt = str(tmp_path / algorithm / "ref"), str(tmp_path / algorithm / "ckpt")
        run = base + settings(algorithm)
        argvs += [run + ["--save", ref],
                  run + ["--save", ckpt, "--exit-interval", str(PAUSE)],
                  run + ["--save", ckpt, "--load", ckpt]]
        dirs[algorithm] = (ref, ckpt)
    records = run_distributed_many(argvs, 2)
    for i, algorithm in enumerate(ALGORITHMS):
        ref, paused, resumed = records[3 * i: 3 * i + 3]
        for r, (whole, first, rest) in enumerate(zip(ref, paused, resumed)):
            assert first["losses"] and rest["losses"], f"{algorithm}: rank {r} did not pause and resume"
            assert all(torch.isfinite(torch.tensor(whole["losses"]))), f"{algorithm}: rank {r} diverged"
            assert first["losses"] + rest["losses"] == whole["losses"], \
                f"{algorithm}: rank {r}'s losses after the resume differ from the uninterrupted run's"
            for name, p in whole["params"].items():
                assert torch.equal(rest["params"][name]["value"], p["value"]), f"{algorithm}: rank {r}'s {name}"
        assert ref[0]["comm"]["bytes_sent"] > 0, f"{algorithm}: nothing crossed sites"
        ref_dir, ckpt_dir = (_tracker(d) for d in dirs[algorithm])
        assert os.path.basename(ref_dir) == os.path.basename(ckpt_dir)
        assert_same(load_tree(ref_dir), load_tree(ckpt_dir), f"{algorithm}: {os.path.basename(ref_dir)}")


# A non-default value of each shared option group (config.SHARED_GROUPS), refused by an
# algorithm that does not use the group.
SHARED_PROBES = {"rounds": ["--lsgd-interval", "3"], "outer": ["--lsgd-outer-lr", "0.5"],
                 "compression": ["--lsgd-compression", "int8"]}


def _refused(argv: List[str], monkeypatch, capsys) -> str:
    """The one error line a world of one, in this process, stops with (exit code 2)."""
    code = run_single(argv, monkeypatch)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and "Traceback" not in err, err
    assert lines[-1].startswith("error: ") and sum(line.startswith("error: ") for line in lines) == 1, err
    return lines[-1]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_refuses_what_it_does_not_support(algorithm, monkeypatch, capsys):
    cls = synchronizer_class(algorithm)
    if cls.fault_tolerance_refusal is not None:  # a site is a world of its own: here, a world of one
        line = _refused(settings(algorithm) + ["--num-sites", "2", "--lsgd-fault-tolerance", "torchft",
                                               "--lsgd-site", "0", "--train-iters", "2"], monkeypatch, capsys)
        assert f"does not support --lsgd-algorithm {algorithm}: {cls.fault_tolerance_refusal} (" in line
        # its own reason, not the protocol's placeholder (docs/fault_tolerance.md lists them)
        assert cls.fault_tolerance_refusal != Synchronizer.fault_tolerance_refusal, algorithm
    if cls.requires_multiple_sites:
        line = _refused(settings(algorithm) + ["--num-sites", "1", "--train-iters", "2"], monkeypatch, capsys)
        assert f"--lsgd-algorithm {algorithm} needs --num-sites >= 2" in line
    # The checks below need more ranks than this process: made where the run makes them
    # (build_config's ValueError is the run's one error line).
    for group, probe in SHARED_PROBES.items():  # a shared option group it does not declare in `uses`
        if group not in cls.uses:
            with pytest.raises(ValueError, match=f"^{probe[0]} .*--lsgd-algorithm {algorithm}"):
                build_config(parse_args(TINY + settings(algorithm) + ["--num-sites", "2", "--train-iters", "2"]
                                        + probe), 2)
    unequal = parse_args(TINY + settings(algorithm) + ["--num-sites", "2", "--site-data-parallel-sizes", "2,1",
                                                        "--global-batch-size", "12", "--train-iters", "2"])
    if cls.unequal_sites_refusal is None:
        assert build_config(unequal, 3).dims.site_dp == (2, 1)
    else:
        with pytest.raises(ValueError) as err:
            build_config(unequal, 3)
        assert "--site-data-parallel-sizes 2,1" in str(err.value) and cls.unequal_sites_refusal in str(err.value)
        assert "\n" not in str(err.value)
