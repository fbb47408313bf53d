"""topk-2bit (SparseLoCo): the payload round trip, the error-feedback invariant with and
without decay, and, across two spawned gloo sites, bit-identical means built from each
site's own choices, with the bytes counted equal to the bytes all-gathered."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from megatron_lsgd.core.lsgd.comm import InterSiteComm
from megatron_lsgd.core.lsgd.compressors import build_compressor
from megatron_lsgd.core.lsgd.config import CompressionOptions
from megatron_lsgd.core.lsgd.reduction import run_blocking
from megatron_lsgd.core.lsgd.sparse import SparseLayout, decode, encode, topk_per_chunk
from tests.unit_tests.harness import free_port, spawn

ONE_SITE = InterSiteComm(None, 1)


def test_round_trip_keeps_the_top_k_of_each_chunk_within_a_quarter_scale():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g)  # 3 full chunks of 300 and a padded one of 100
    layout = SparseLayout(1000, 300, 9)
    payload = encode(x, layout)
    assert payload.dtype == torch.uint8 and payload.numel() == layout.nbytes == 4 * 4 + 2 * 36 + 9
    y = decode(payload, layout)
    assert y.shape == x.shape
    for c in range(4):
        xc, yc = x[c * 300:(c + 1) * 300], y[c * 300:(c + 1) * 300]
        top = xc.abs().topk(9).indices
        kept = yc != 0
        assert kept.sum() == 9 and kept[top].all()  # exactly the chunk's 9 largest magnitudes
        a = xc.abs().max()
        assert (yc[kept] - xc[kept]).abs().max() <= a / 4 + 1e-6
        assert torch.equal(torch.sign(yc[kept]), torch.sign(xc[kept]))
        assert set(yc[kept].abs().unique().tolist()) <= {float(a * 0.25), float(a * 0.75)}
    assert topk_per_chunk(1 / 64, 4096) == 64 and topk_per_chunk(1e-9, 100) == 1 and topk_per_chunk(1.0, 7) == 7


@pytest.mark.parametrize("decay", [1.0, 0.9])
def test_error_feedback_invariant_sent_plus_residual_is_input_plus_decayed_old_residual(decay):
    shapes = [torch.Size([700]), torch.Size([45])]
    opts = CompressionOptions(kind="topk-2bit", topk_density=0.05, topk_chunk=128, ef_decay=decay)
    comp = build_compressor(opts, ONE_SITE, shapes, [], seed=0, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        xs = [torch.randn(s, generator=g) for s in shapes]
        old = [e.clone() for e in comp.errors]
        sent = run_blocking(comp.reduce(xs))  # one site: the mean is exactly what was sent
        for x, o, s, e in zip(xs, old, sent, comp.errors):
            torch.testing.assert_close(s + e, x + decay * o, rtol=0, atol=1e-6)
            assert (s != 0).sum() < s.numel() / 5  # really sparse
    assert comp.last_error_norm > 0
    # 745 values in 6 chunks of 128, 6 (= round(0.05 x 128)) kept per chunk
    assert comp.payload_bytes_per_round() == 6 * 4 + 2 * 36 + 9


def _two_sites(rank, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    comm = InterSiteComm(dist.group.WORLD, 2)
    opts = CompressionOptions(kind="topk-2bit", topk_density=0.02, topk_chunk=256)
    comp = build_compressor(opts, comm, [torch.Size([1500])], [], seed=0, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(10 + rank)
    rounds = []
    for _ in range(3):
        x = torch.randn(1500, generator=g)
        before = comm.bytes_sent
        mean = run_blocking(comp.reduce([x]))[0]
        sent = x + (rounds[-1]["error"] if rounds else 0) - comp.errors[0]  # what this site contributed
        rounds.append({"mean": mean, "sent": sent, "error": comp.errors[0].clone(),
                       "bytes": comm.bytes_sent - before, "payload": comp.payload_bytes_per_round()})
    torch.save(rounds, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_sites_agree_bit_for_bit_and_count_the_bytes_all_gathered():
    with tempfile.TemporaryDirectory() as d:
        spawn(_two_sites, args=(free_port(), d), nprocs=2)
        r0, r1 = (torch.load(os.path.join(d, f"{r}.pt")) for r in range(2))
    for a, b in zip(r0, r1):
        assert torch.equal(a["mean"], b["mean"])  # each site decoded both payloads identically
        torch.testing.assert_close((a["sent"] + b["sent"]) / 2, a["mean"], rtol=0, atol=1e-6)
        assert not torch.equal(a["sent"] != 0, b["sent"] != 0)  # each site chose its own entries
        # 1500 values: 6 chunks of 256, 5 kept each; one payload crosses per round with 2 sites
        assert a["bytes"] == b["bytes"] == a["payload"] == 6 * 4 + 2 * 30 + 8


ALGORITHMS = {  # every algorithm that takes --lsgd-compression, with rounds short enough for 4 steps
    "sync": [], "diloco": ["--lsgd-interval", "2"], "dilocox": ["--lsgd-interval", "2"],
    "streaming-diloco": ["--lsgd-interval", "4", "--lsgd-fragments", "2"],
    "cocodc": ["--lsgd-interval", "4", "--lsgd-fragments", "2"],
    "edit": ["--lsgd-interval", "2"], "a-edit": ["--lsgd-aedit-interval-seconds", "0.05"], "acco": [], "dpu": [],
}


@pytest.mark.slow
def test_every_compressing_algorithm_runs_topk_2bit_per_fragment_with_identical_replicas():
    from tests.unit_tests.harness import assert_replicas_identical, logged_losses, run_distributed_many
    from tests.unit_tests.lsgd.test_algorithms import COMMON

    plain = COMMON + ["--num-sites", "2", "--train-iters", "4", "--lr", "5e-3"]
    base = plain + ["--lsgd-compression", "topk-2bit", "--lsgd-topk-chunk", "256", "--lsgd-topk-density", "0.05",
                    "--lsgd-ef-decay", "0.95"]
    runs = run_distributed_many([plain + ["--lsgd-algorithm", "sync"]]
                                + [base + ["--lsgd-algorithm", a] + extra for a, extra in ALGORITHMS.items()], 2)
    fp32_sync, runs = runs[0], dict(zip(ALGORITHMS, runs[1:]))
    for name, run in runs.items():
        losses = logged_losses(run)
        assert all(torch.isfinite(torch.tensor(losses))), name
        if name not in ("a-edit",):  # a-edit's sites may stop between meetings
            assert_replicas_identical(run)
        assert run[-1]["comm"]["bytes_sent"] > 0, name
    # sync sends every step: 4 x (payload of the whole model) against fp32's ring all-reduce
    ratio = fp32_sync[-1]["comm"]["bytes_sent"] / runs["sync"][-1]["comm"]["bytes_sent"]
    assert 25 < ratio < 40, ratio  # 13 of 256 values: 4 + 26 + 4 bytes per 1 KiB of fp32
