"""Every parallel layout trains exactly like one rank (fp32, CPU/gloo, dropout off).

Losses of each logged iteration and all parameters after the run must match the
single-rank run to 1e-5 relative.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit_tests.harness import assert_replicas_identical, logged_losses, merge_full_params, run_distributed

COMMON = ["--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "6",
          "--lr", "2e-3", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--min-lr", "1e-4",
          "--mock-data", "--vocab-size", "250", "--make-vocab-size-divisible-by", "32", "--log-interval", "1",
          "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0", "--clip-grad", "0.5",
          "--weight-decay", "0.1", "--seed", "7",
          # Adam turns noise-level gradients (the key bias has a true gradient of exactly 0)
          # into lr-sized steps; a larger eps keeps those steps negligible.
          "--adam-eps", "1e-6"]
GPT2 = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
LLAMA = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
         "--num-query-groups", "2", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights"]

LAYOUTS = {
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8", "--micro-batch-size", "2"]),
    "dp2": (2, []),
    "dp2-zero1-overlap": (2, ["--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "3000"]),
    "sites2-sync": (2, ["--num-sites", "2", "--lsgd-algorithm", "sync"]),
    "tp2-pp2-dp2-zero1": (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                              "--use-distributed-optimizer"]),
    "tp2-pp2-sites2-sp": (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                              "--num-sites", "2", "--sequence-parallel"]),
}

_reference_cache = {}


def reference(model_args):
    key = tuple(model_args)
    if key not in _reference_cache:
        _reference_cache[key] = run_distributed(COMMON + model_args, 1)
    return _reference_cache[key]


def assert_matches(reference_records, records):
    ref_losses, losses = logged_losses(reference_records), logged_losses(records)
    assert len(ref_losses) == 6 and len(losses) == 6
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(ref_losses, dtype=torch.float64), rtol=1e-5, atol=0)
    assert ref_losses[-1] < ref_losses[0], "the reference run should learn"
    ref_params, params = merge_full_params(reference_records), merge_full_params(records)
    assert ref_params.keys() == params.keys()
    for name in ref_params:
        torch.testing.assert_close(params[name], ref_params[name], rtol=1e-5, atol=1e-6, msg=name)
    assert_replicas_identical(records)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_rank(layout, family):
    model_args = GPT2 if family == "gpt2" else LLAMA
    world, layout_args = LAYOUTS[layout]
    records = run_distributed(COMMON + model_args + layout_args, world)
    assert_matches(reference(model_args), records)
