"""dpu/acco flags: bad settings fail at start with a message naming the flag; the shared
option group belongs to both algorithms; the micro-batch bound the loop sizes the data for."""

import subprocess
import sys

import pytest

from megatron_lsgd.core.lsgd.algorithms.acco import AccoOptions, DpuOptions
from megatron_lsgd.training.arguments import build_config, parse_args

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "1", "--lr", "1e-3", "--mock-data", "--vocab-size", "100", "--num-sites", "2"]
ITERS = ["--train-iters", "10"]


def config(extra, world=2):
    return build_config(parse_args(BASE + extra), world)


@pytest.mark.parametrize("extra,flag", [
    (ITERS + ["--lsgd-algorithm", "acco", "--global-batch-size", "2"], "--global-batch-size"),
    (ITERS + ["--lsgd-algorithm", "acco", "--global-batch-size", "8", "--lsgd-site-microbatches", "1,4"],
     "at least 2 micro-batches"),
    (ITERS + ["--lsgd-algorithm", "dpu", "--lsgd-site-microbatches", "2"], "--lsgd-site-microbatches '2'"),
    (ITERS + ["--lsgd-algorithm", "dpu", "--lsgd-site-microbatches", "2,x"], "--lsgd-site-microbatches"),
    (ITERS + ["--lsgd-algorithm", "dpu", "--lsgd-site-microbatches", "0,2"], "--lsgd-site-microbatches"),
    (ITERS + ["--lsgd-algorithm", "dpu", "--lsgd-max-microbatches", "-1"], "--lsgd-max-microbatches"),
    (ITERS + ["--lsgd-algorithm", "acco", "--global-batch-size", "8", "--lsgd-max-microbatches", "1"],
     "--lsgd-max-microbatches 1 is below"),
    (ITERS + ["--lsgd-algorithm", "dpu", "--fp16"], "--fp16 is not supported by --lsgd-algorithm dpu"),
    (["--train-samples", "40", "--lsgd-algorithm", "acco", "--global-batch-size", "4"],
     "--train-samples needs --lsgd-accumulation fixed"),
    (["--train-tokens", "4000", "--lsgd-algorithm", "dpu", "--lsgd-accumulation", "fixed",
      "--lsgd-site-microbatches", "1,2"], "--train-tokens needs"),
    (ITERS + ["--lsgd-algorithm", "acco", "--global-batch-size", "4", "--calculate-per-token-loss"],
     "--calculate-per-token-loss is not supported by --lsgd-algorithm acco"),
    (ITERS + ["--lsgd-algorithm", "acco", "--lsgd-accumulation", "fixed", "--global-batch-size", "8",
              "--rampup-batch-size", "2", "2", "16"], "--rampup-batch-size is not supported by --lsgd-algorithm acco"),
    (ITERS + ["--lsgd-algorithm", "dpu", "--global-batch-size", "8", "--rampup-batch-size", "2", "2", "16"],
     "--rampup-batch-size needs --lsgd-accumulation fixed"),
    (ITERS + ["--lsgd-algorithm", "sync", "--lsgd-accumulation", "fixed"],
     "--lsgd-accumulation needs --lsgd-algorithm acco or dpu"),
    (ITERS + ["--lsgd-algorithm", "diloco", "--lsgd-site-microbatches", "1,1"],
     "--lsgd-site-microbatches needs --lsgd-algorithm acco or dpu"),
    (ITERS + ["--lsgd-algorithm", "dpu", "--lsgd-dpu-warmup-iters", "-1"], "--lsgd-dpu-warmup-iters must be >= 0"),
    (ITERS + ["--lsgd-algorithm", "acco", "--global-batch-size", "4", "--lsgd-dpu-warmup-iters", "5"],
     "--lsgd-dpu-warmup-iters needs --lsgd-algorithm dpu"),
])
def test_bad_flags_name_the_flag(extra, flag):
    with pytest.raises(ValueError, match=flag):
        config(extra)


def test_good_flags_build():
    cfg = config(["--train-samples", "40", "--global-batch-size", "4", "--lsgd-algorithm", "acco",
                  "--lsgd-accumulation", "fixed", "--lsgd-compression", "int8"])
    assert isinstance(cfg.lsgd.algo, AccoOptions) and cfg.lsgd.algo.accumulation == "fixed"
    cfg = config(ITERS + ["--lsgd-algorithm", "dpu", "--lsgd-site-microbatches", "3,1", "--lsgd-dpu-warmup-iters", "4"])
    assert type(cfg.lsgd.algo) is DpuOptions and cfg.lsgd.algo.site_counts(2, 1) == [3, 1]
    assert cfg.lsgd.algo.warmup_iters == 4


def test_stage_split_and_bound():
    acco = AccoOptions(accumulation="adaptive", site_microbatches="2,5", max_microbatches=0)
    assert acco.stage_minimums(5) == [2, 3]  # estimate stage first
    assert acco.stage_cap(2) == 32  # 16 x the minimum
    dpu = DpuOptions(accumulation="fixed")
    assert dpu.stage_minimums(3) == [3] and dpu.stage_cap(3) == 3
    assert DpuOptions(max_microbatches=10).stage_cap(2) == 10


def test_bad_flag_exits_2_with_one_line():
    root = __file__.rsplit("/tests/", 1)[0]
    args = BASE[:BASE.index("--num-sites")] + ITERS  # one rank, one site: 1 micro-batch per step
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", *args, "--lsgd-algorithm", "acco"],
                          capture_output=True, text=True, timeout=120, cwd=root)
    assert proc.returncode == 2
    assert "error: --lsgd-algorithm acco splits" in proc.stderr and "Traceback" not in proc.stderr
