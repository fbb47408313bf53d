"""Compression on one site (collectives are local copies): low rank is exact on rank-r
matrices, error feedback conserves mass, segments split ZeRO-1 pieces correctly."""

import pytest
import torch

from megatron_lsgd.core.lsgd.comm import InterSiteComm
from megatron_lsgd.core.lsgd.compressors import build_compressor, split_segments
from megatron_lsgd.core.lsgd.config import CompressionOptions
from megatron_lsgd.core.lsgd.means import effective_rank, lowrank_mean, quantized_mean
from megatron_lsgd.core.lsgd.reduction import PendingReduce, run_blocking

ONE_SITE = InterSiteComm(None, 1)


def rank_r(m, n, r, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, r, generator=g) @ torch.randn(r, n, generator=g)


@pytest.mark.parametrize("r", [1, 3, 8])
def test_lowrank_exact_on_rank_r_matrices(r):
    mats = [rank_r(40, 24, r, 0), rank_r(16, 33, r, 1)]
    g = torch.Generator().manual_seed(r)
    qs = [torch.randn(24, r, generator=g), torch.randn(33, r, generator=g)]
    res = run_blocking(lowrank_mean(ONE_SITE, mats, qs, torch.zeros(0), None, 64, "auto", 0.99))
    for m, approx in zip(mats, res.mean):
        assert (approx - m).norm() <= 1e-3 * m.norm()  # fp32 QR; worst seen over 600 cases 6e-5
    assert all(1 <= k <= r for k in res.effective_ranks)
    # One rank lower is not enough: the check above can fail.
    res_low = run_blocking(lowrank_mean(ONE_SITE, mats, [q[:, :max(1, r - 1)] for q in qs], torch.zeros(0),
                                        None, 64, "auto", 0.99))
    if r > 1:
        assert (res_low.mean[0] - mats[0]).norm() > 1e-2 * mats[0].norm()


def test_effective_rank():
    p = torch.diag(torch.tensor([10.0, 3.0, 1.0, 0.1]))
    assert effective_rank(p, 0.9) == 1 and effective_rank(p, 0.95) == 2 and effective_rank(p, 0.999) == 3
    assert effective_rank(torch.zeros(3, 2), 0.9) == 1


@pytest.mark.parametrize("compression,rank", [("int8", 0), ("int4", 0), ("lowrank-int4", 2)])
def test_error_feedback_conserves_mass(compression, rank):
    shapes = [torch.Size([48 * 20 + 5]), torch.Size([40])]
    layout = [[((48, 20), 0, 960, 0, 960), ((5,), 0, 5, 960, 965)], [((40,), 0, 40, 0, 40)]]
    red = build_compressor(CompressionOptions(kind=compression, rank=rank, quant_block=32), ONE_SITE, shapes, layout,
                           seed=3, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    total_in = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    total_out = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    for _ in range(6):
        deltas = [torch.randn(s, generator=g) for s in shapes]
        means = run_blocking(red.reduce(deltas))
        for i in range(2):
            total_in[i] += deltas[i].double()
            total_out[i] += means[i].double()  # one site: the mean is exactly what was sent
    assert red.last_error_norm > 0  # lossy compression really ran
    for tin, tout, e in zip(total_in, total_out, red.errors):
        torch.testing.assert_close(tout + e.double(), tin, rtol=0, atol=1e-4)


def test_quantized_mean_error_bound_one_site():
    x = torch.randn(1000)
    mean, sent = run_blocking(quantized_mean(ONE_SITE, x, 4, 64))
    assert torch.equal(mean, sent)
    assert (mean - x).abs().max() <= x.abs().max() / 14 + 1e-6


def test_segments_split_ragged_zero1_pieces():
    # A (10, 8) weight whose shard covers flattened [5, 77): whole rows 1..8 become a matrix.
    segs = split_segments([[((10, 8), 5, 77, 0, 72), ((8,), 0, 8, 72, 80)]], rank=2)
    kinds = [(s.lo, s.hi, s.rows, s.cols) for s in segs]
    assert kinds == [(0, 3, 0, 0), (3, 67, 8, 8), (67, 72, 0, 0), (72, 80, 0, 0)]
    # rank too large to save anything: whole piece stays in the remainder
    assert all(not s.is_matrix for s in split_segments([[((10, 8), 0, 80, 0, 80)]], rank=5))


def test_pending_reduce_poll_and_wait():
    class Handle:
        def __init__(self):
            self.ready = False

        def is_completed(self):
            return self.ready

        def wait(self):
            self.ready = True

    handles = [Handle(), Handle()]

    def gen():
        yield handles[0]
        yield handles[1]
        return "done"

    p = PendingReduce(gen())
    assert not p.poll()
    handles[0].ready = True
    assert not p.poll()  # advanced to the second collective, still running
    assert p.wait() == "done" and p.done


def test_the_compression_error_statistic_is_one_for_every_algorithm():
    from types import SimpleNamespace

    from megatron_lsgd.core.lsgd.compressors import compression_error

    def ran(err, inp):
        return SimpleNamespace(last_error_norm=err, last_input_norm=inp)

    assert compression_error([None, ran(0.0, 0.0)]) == {}  # nothing compressed yet
    assert compression_error([ran(0.5, 2.0)]) == {"comp err norm": 0.5, "comp rel err": 0.25}
    both = compression_error([ran(3.0, 4.0), None, ran(4.0, 3.0)])  # fragments: one vector's norms
    assert both["comp err norm"] == pytest.approx(5.0) and both["comp rel err"] == pytest.approx(1.0)
