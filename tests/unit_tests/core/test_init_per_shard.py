"""Per-shard model initialisation (core/tensor_parallel/initialize.py, training/model_build.py),
the path a GPU run takes, checked on CPU: a model built on the meta device, its parameters
materialised and drawn piece by piece on the host (pieces far smaller than a parameter),
equals the exact host path bit for bit, for every TP rank and pipeline stage, with column-
and row-parallel weights, SwiGLU's interleaved halves, GQA, tied and untied embeddings."""

from __future__ import annotations

import math

import pytest
import torch

import pretrain_gpt
from megatron_lsgd.core.parallel_state import ProcessGroups
from megatron_lsgd.core.tensor_parallel.initialize import _initialize_shard, master_value, row_pieces
from megatron_lsgd.core.tensor_parallel.random import RNGStatesTracker
from megatron_lsgd.training.arguments import build_config, parse_args
from megatron_lsgd.training.model_build import build_model

CPU = torch.device("cpu")
MODEL = ["--num-layers", "4", "--hidden-size", "40", "--ffn-hidden-size", "72", "--num-attention-heads", "4",
         "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "8",
         "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--vocab-size", "100",
         "--make-vocab-size-divisible-by", "8", "--seed", "11"]
LLAMA = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
         "--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights"]


def test_row_pieces_are_whole_rows_aligned_on_16_values():
    for rows, row_size, most in [(100, 7, 64), (33, 16, 16), (5, 3, 1), (1000, 1, 40), (9, 48, 100), (2, 5, 64)]:
        pieces = row_pieces(rows, row_size, most)
        assert pieces[0][0] == 0 and pieces[-1][1] == rows
        assert all(a == b_prev for (_, b_prev), (a, _) in zip(pieces, pieces[1:]))
        assert all((b - a) * row_size % 16 == 0 for a, b in pieces[:-1])
        assert len(pieces) == 1 or (pieces[-1][1] - pieces[-1][0]) * row_size >= 16
        unit = 16 // math.gcd(row_size, 16)
        assert all((b - a) <= max(unit, most // row_size) for a, b in pieces[:-1])
    assert len(row_pieces(100, 7, 64)) > 5  # really in pieces


@pytest.mark.parametrize("shape", [(33, 7), (5, 3), (100,), (17, 16, 3), (3,)])
def test_a_draw_in_pieces_is_one_draw(shape):
    p = torch.nn.Parameter(torch.full(shape, float("nan")))
    p.init_kind, p.init_std = "normal", 0.02
    _initialize_shard("w", p, 5, 1, 0, max_elements=16)
    assert torch.equal(p.detach(), master_value("w", shape, "normal", 0.02, 5))


def _pgs(config, rank):
    dims = config.dims
    return ProcessGroups(dims=dims, rank=rank, coords=dims.coords(rank))


@pytest.mark.parametrize("extra", [[], LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_a_meta_built_model_initialised_per_shard_equals_the_exact_path(extra, tp, pp):
    argv = MODEL + extra + ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    config = build_config(parse_args(argv), tp * pp)
    config.model.padded_vocab_size = 104
    for rank in range(tp * pp):
        pgs = _pgs(config, rank)
        tracker = RNGStatesTracker(CPU)
        exact = build_model(pretrain_gpt.model_provider, config, pgs, tracker, CPU, per_shard=False)
        sharded = build_model(pretrain_gpt.model_provider, config, pgs, tracker, CPU, per_shard=True,
                              max_host_elements=256)  # pieces of a few rows: every parameter in many pieces
        a, b = dict(exact.named_parameters()), dict(sharded.named_parameters())
        assert a.keys() == b.keys() and a
        for name in a:
            assert not b[name].is_meta and torch.equal(a[name], b[name]), (rank, name)
            assert vars(a[name]).keys() == vars(b[name]).keys(), name  # partition metadata kept
        assert all(torch.equal(x, y) for x, y in zip(exact.buffers(), sharded.buffers()))


def test_the_per_shard_model_computes_what_the_exact_one_does():
    config = build_config(parse_args(MODEL + LLAMA), 1)
    config.model.padded_vocab_size = 104
    pgs = _pgs(config, 0)
    models = [build_model(pretrain_gpt.model_provider, config, pgs, RNGStatesTracker(CPU), CPU, per_shard=s,
                          max_host_elements=64) for s in (False, True)]
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(16).expand(2, 16)
    outs = []
    for model in models:
        model.eval()
        outs.append(model(ids, pos, labels=ids))
    assert torch.equal(outs[0], outs[1])
