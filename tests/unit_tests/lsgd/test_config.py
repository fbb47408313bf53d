"""Incompatible lsgd flags fail at start with a message naming the flag."""

import pytest

from megatron_lsgd.training.arguments import build_config, parse_args

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "1", "--train-iters", "10", "--lr", "1e-3", "--mock-data", "--vocab-size", "100"]


def config(extra, world=2):
    return build_config(parse_args(BASE + extra), world)


@pytest.mark.parametrize("extra,flag", [
    (["--num-sites", "2", "--lsgd-algorithm", "diloco", "--lsgd-interval", "0"], "--lsgd-interval"),
    (["--num-sites", "2", "--lsgd-algorithm", "diloco", "--lsgd-outer-lr", "0"], "--lsgd-outer-lr"),
    (["--num-sites", "2", "--lsgd-algorithm", "diloco", "--lsgd-outer-momentum", "1.0"], "--lsgd-outer-momentum"),
    (["--num-sites", "2", "--lsgd-algorithm", "diloco", "--lsgd-compression", "int4"], "--lsgd-compression"),
    (["--num-sites", "2", "--lsgd-algorithm", "dilocox", "--lsgd-compression", "lowrank-int4"], "--lsgd-rank"),
    (["--num-sites", "2", "--lsgd-algorithm", "dilocox", "--lsgd-compression", "int4", "--lsgd-rank", "4"],
     "--lsgd-rank"),
    (["--num-sites", "2", "--lsgd-algorithm", "diloco", "--lsgd-adaptive"], "--lsgd-adaptive"),
    (["--num-sites", "2", "--lsgd-algorithm", "dilocox", "--lsgd-quant-block", "3"], "--lsgd-quant-block"),
    (["--num-sites", "2", "--lsgd-algorithm", "dilocox", "--lsgd-adaptive", "--lsgd-adaptive-h-min", "10",
      "--lsgd-adaptive-h-max", "5"], "--lsgd-adaptive-h-min"),
    (["--num-sites", "2", "--simulate-inter-site-bandwidth", "-1"], "--simulate-inter-site-bandwidth"),
    (["--num-sites", "1", "--lsgd-algorithm", "dilocox"], "--num-sites"),
    (["--num-sites", "2", "--lsgd-algorithm", "dilocox", "--lsgd-interval", "10", "--lsgd-dilocox-apply-step", "11"],
     "--lsgd-dilocox-apply-step"),
    (["--num-sites", "2", "--lsgd-algorithm", "dilocox", "--lsgd-dilocox-apply-step", "-1"],
     "--lsgd-dilocox-apply-step"),
    (["--num-sites", "2", "--lsgd-algorithm", "diloco", "--lsgd-dilocox-apply-step", "2"], "--lsgd-dilocox-apply-step"),
])
def test_bad_flags_name_the_flag(extra, flag):
    with pytest.raises(ValueError, match=flag):
        config(extra)


def test_good_flags_build():
    cfg = config(["--num-sites", "2", "--lsgd-algorithm", "dilocox", "--lsgd-compression", "lowrank-int4",
                  "--lsgd-rank", "8", "--lsgd-adaptive", "--lsgd-interval", "25", "--optimizer", "sgd"])
    assert cfg.lsgd.rank == 8 and cfg.lsgd.adaptive_h_min == 25 and cfg.lsgd.adaptive_h_max == 100
    assert cfg.optimizer.optimizer == "sgd"
