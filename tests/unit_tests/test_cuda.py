"""What only a GPU can show (marked `cuda`: skipped with the reason on CPU machines; run by
tools/gpu_check.sh). Each test is the GPU side of a CPU-tested property: staged inter-site
payloads (also the elastic comm's host payloads on NCCL), host-side outer state, device-side searchsorted, bf16 cross-entropy, GQA through
SDPA's kernels, recomputation, the peak-memory figures, acco/dpu's worker stream and its
two events, the device-synchronised clock and per-shard initialisation on the device."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_lsgd.core.lsgd.comm import InterSiteComm
from megatron_lsgd.core.lsgd.config import OuterOptions
from megatron_lsgd.core.lsgd.devices import InterSiteDevices, WrongDevice
from megatron_lsgd.core.lsgd.means import effective_rank, quantized_mean
from megatron_lsgd.core.lsgd.outer_state import OuterState
from megatron_lsgd.core.lsgd.reduction import run_blocking
from megatron_lsgd.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_lsgd.training.logging_utils import peak_cuda_memory_mb
from tests.unit_tests.harness import free_port

pytestmark = pytest.mark.cuda
GPU = torch.device("cuda", 0)


def _gloo_between_sites_on_one_gpu(rank, port, out_dir):
    """Two 'sites' on one GPU, gloo between them: CUDA payloads go through pinned buffers."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    staged = InterSiteComm(dist.group.WORLD, 2, devices=InterSiteDevices(group=torch.device("cpu"), run=GPU))
    host = InterSiteComm(dist.group.WORLD, 2)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(rank))
    out = {}
    for bits, variant in ((None, "auto"), (8, "allgather"), (4, "alltoall")):
        on_gpu = run_blocking(quantized_mean(staged, x.to(GPU), bits, 64, variant))[0]
        on_host = run_blocking(quantized_mean(host, x.clone(), bits, 64, variant))[0]
        out[(bits, variant)] = (on_gpu.device.type, on_gpu.cpu(), on_host)
    out["pinned"] = all(b.is_pinned() for pool in staged.staging._free.values() for b in pool)
    torch.save(out, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def test_gloo_between_sites_stages_cuda_payloads_through_pinned_memory():
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_gloo_between_sites_on_one_gpu, args=(free_port(), d), nprocs=2, join=True)
        records = [torch.load(os.path.join(d, f"{r}.pt"), weights_only=False) for r in range(2)]
    for rec in records:
        assert rec["pinned"]
        for key, (device, on_gpu, on_host) in ((k, v) for k, v in rec.items() if k != "pinned"):
            assert device == "cuda", key
            # quantization runs on the GPU with torch kernels, on the host with C++ ones: the
            # same grid, so they differ by at most one step where a value rounds the other way
            step = {None: 0.0, 8: 0.05, 4: 0.6}[key[0]]
            torch.testing.assert_close(on_gpu, on_host, rtol=0, atol=step)


def _elastic_comm_on_nccl(rank, port, out_dir):
    """ElasticComm over a real NCCL group of one rank, called as torchft's group is (its
    list-form collectives), with --lsgd-outer-offload's host payloads in pinned memory."""
    from megatron_lsgd.core.lsgd.fault_tolerance.elastic_comm import ElasticComm

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    comm = ElasticComm(2, devices=InterSiteDevices(group=GPU, run=GPU, host_payloads=True))
    comm.set_sites(dist.group.WORLD, 2)  # as if two sites: the sum over one rank is the payload itself
    out = {}
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0)).pin_memory()
    expected = x / 2
    work = comm.all_reduce_mean(x, async_op=True)
    work.wait()
    out["mean"] = (x.device.type, torch.equal(x, expected))
    swapped = torch.empty(1 << 20).pin_memory()
    comm.all_to_all(swapped, x)
    out["all_to_all"] = torch.equal(swapped, expected)
    m = torch.tensor([3.0])
    comm.all_reduce_max(m)
    out["max"] = m.item()
    out["staged_on_gpu"] = all(b.is_cuda for pool in comm.staging._free.values() for b in pool)
    torch.save(out, os.path.join(out_dir, "0.pt"))
    dist.destroy_process_group()


def test_the_elastic_comm_stages_host_payloads_for_nccl():
    # the GPU side of tests/unit_tests/lsgd/test_elastic_comm.py (one GPU: NCCL across sites
    # needs a GPU per site, gpu_check.sh's elastic row on 2+ GPUs)
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_elastic_comm_on_nccl, args=(free_port(), d), nprocs=1, join=True)
        rec = torch.load(os.path.join(d, "0.pt"), weights_only=False)
    assert rec == {"mean": ("cpu", True), "all_to_all": True, "max": 3.0, "staged_on_gpu": True}


def test_a_host_tensor_for_an_nccl_group_is_refused():
    comm = InterSiteComm(None, 2, devices=InterSiteDevices(group=GPU, run=GPU))
    with pytest.raises(WrongDevice):
        comm.all_reduce_mean(torch.ones(3))


def test_offloaded_outer_state_pseudo_gradient_waits_for_its_copy():
    shard = torch.randn(1 << 22, device=GPU)
    state = OuterState([shard], OuterOptions(lr=0.7, momentum=0.9, offload=True))
    assert state.anchors[0].is_pinned()

    class Views:  # the whole shard as one range
        key, main = "all", [shard]

        @staticmethod
        def select(tensors):
            return list(tensors)

    expected = state.anchors[0] - (shard * 3).cpu()
    shard.mul_(3)  # queued on the stream; the pseudo-gradient must see it
    (delta,) = state.pseudo_gradient(Views)
    assert torch.equal(delta, expected)


def test_effective_rank_on_device():
    p = torch.randn(64, 8, device=GPU) @ torch.diag(torch.tensor([10.0, 1, 1, 1, 1, 1, 1, 1], device=GPU))
    assert effective_rank(p, 0.5) == effective_rank(p.cpu(), 0.5)


def test_bf16_cross_entropy_matches_its_fp32_values():
    logits = torch.randn(8, 4, 1000, device=GPU).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, 1000, (8, 4), device=GPU)
    wide = logits.detach().float().requires_grad_()
    ours, ref = vocab_parallel_cross_entropy(logits, target, None), vocab_parallel_cross_entropy(wide, target, None)
    assert torch.equal(ours, ref)


def test_gqa_through_sdpa_on_the_gpu():
    import torch.nn.functional as F

    q = torch.randn(2, 16, 256, 64, device=GPU, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 4, 256, 64, device=GPU, dtype=torch.bfloat16) for _ in range(2))
    ours = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    copies = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), is_causal=True)
    torch.testing.assert_close(ours, copies, rtol=2e-2, atol=2e-2)


def test_peak_cuda_memory_is_reported():
    torch.cuda.reset_peak_memory_stats(GPU)
    x = torch.empty(64 << 20, dtype=torch.uint8, device=GPU)
    peak = peak_cuda_memory_mb(GPU)
    del x
    assert peak["peak_cuda_allocated_mb"] >= 64 and peak["peak_cuda_reserved_mb"] >= 64


def test_the_acco_worker_thread_computes_on_the_ranks_gpu_on_a_stream_of_its_own():
    from megatron_lsgd.core.lsgd.algorithms.acco import _Worker
    from megatron_lsgd.core.streams import streams_for

    last = torch.device("cuda", torch.cuda.device_count() - 1)  # not the thread default (0) on multi-GPU hosts
    worker = _Worker("test", last, streams_for(last))
    device, stream = worker.submit(lambda: (torch.cuda.current_device(), torch.cuda.current_stream())).result()
    assert device == last.index
    assert stream != torch.cuda.default_stream(last) and stream != torch.cuda.current_stream(last)


def test_two_events_order_a_hand_over_between_the_compute_and_the_worker_stream():
    from megatron_lsgd.core.lsgd.algorithms.acco import _Worker
    from megatron_lsgd.core.streams import streams_for

    streams = streams_for(GPU)
    worker = _Worker("test", GPU, streams)
    x = torch.zeros(1 << 24, device=GPU)
    torch.cuda._sleep(int(5e8))  # a slow producer on the compute stream: without the wait the worker reads zeros
    x.add_(1)
    handed_over = streams.record()

    def job():
        streams.wait(handed_over)
        y = x * 2
        torch.cuda._sleep(int(5e8))  # a slow job: without the wait the compute stream reads a half-written z
        z = y + 1
        return z, streams.record()

    z, done = worker.submit(job).result()
    streams.wait(done)
    assert torch.equal(z, torch.full_like(x, 3))


def test_the_real_clock_on_a_gpu_waits_for_queued_kernels():
    import time

    from megatron_lsgd.core.clock import Clock

    clock = Clock().for_device(GPU)
    torch.cuda.synchronize()
    t0 = clock.now()
    torch.cuda._sleep(int(1e9))  # ~0.5 s of GPU time, launched in microseconds
    launched = time.perf_counter()
    t1 = clock.now()
    assert t1 - t0 > 0.1 and launched - t0 < (t1 - t0) / 4


def test_per_shard_initialisation_on_the_gpu_equals_the_host_path():
    import pretrain_gpt
    from megatron_lsgd.core.tensor_parallel.random import RNGStatesTracker
    from megatron_lsgd.training.arguments import build_config, parse_args
    from megatron_lsgd.training.model_build import build_model
    from tests.unit_tests.core.test_init_per_shard import LLAMA, MODEL, _pgs

    config = build_config(parse_args(MODEL + LLAMA + ["--tensor-model-parallel-size", "2", "--bf16"]), 2)
    config.model.padded_vocab_size = 104
    for rank in range(2):
        pgs = _pgs(config, rank)
        host = build_model(pretrain_gpt.model_provider, config, pgs, RNGStatesTracker(torch.device("cpu")),
                           torch.device("cpu"))
        gpu = build_model(pretrain_gpt.model_provider, config, pgs, RNGStatesTracker(GPU), GPU)  # meta, per shard
        for (name, a), (_, b) in zip(host.named_parameters(), gpu.named_parameters()):
            assert b.device.type == "cuda" and torch.equal(a, b.cpu()), name


def test_adamw_on_the_gpu_is_the_fused_kernel_and_steps_like_foreach():
    from megatron_lsgd.core.optimizer.sharded_optimizer import _adamw_kernel

    torch.manual_seed(0)
    values = [torch.randn(257, 129, device=GPU), torch.randn(129, device=GPU)]
    grads = [torch.randn_like(v) for v in values]
    kernel = _adamw_kernel([{"params": values}])
    assert kernel == {"fused": True}
    out = {}
    for name, kw in (("fused", kernel), ("foreach", {"foreach": True})):
        params = [torch.nn.Parameter(v.clone()) for v in values]
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **kw)
        for _ in range(3):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
        out[name] = params
    for a, b in zip(out["fused"], out["foreach"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_cpu_runs_optimizer_state_resumes_on_the_fused_gpu_kernel():
    from types import SimpleNamespace

    from megatron_lsgd.core.optimizer.sharded_optimizer import ShardedOptimizer, _adamw_kernel

    cpu = [torch.nn.Parameter(torch.randn(33, 7))]
    saved_by = torch.optim.AdamW(cpu, foreach=True)
    cpu[0].grad = torch.ones_like(cpu[0])
    saved_by.step()
    gpu = [torch.nn.Parameter(cpu[0].detach().to(GPU))]
    here = torch.optim.AdamW(gpu, **_adamw_kernel([{"params": gpu}]))
    ShardedOptimizer._load_torch_state(SimpleNamespace(optimizer=here), saved_by.state_dict())
    assert here.param_groups[0]["fused"] and not here.param_groups[0]["foreach"]
    gpu[0].grad = torch.ones_like(gpu[0])
    here.step()  # the step count went to the device with the moments
    cpu[0].grad = torch.ones_like(cpu[0])
    saved_by.step()
    torch.testing.assert_close(gpu[0].detach().cpu(), cpu[0].detach(), rtol=1e-5, atol=1e-6)


def test_a_compiled_layer_on_the_gpu_gives_the_eager_layers_output_and_gradients(monkeypatch):
    # --compile's unit on the GPU (inductor's Triton kernels): one Llama-style layer, fp32
    import copy

    from megatron_lsgd.core.transformer.compile import compile_layers
    from tests.unit_tests.core.test_compile import llama_layer

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # fp32 products in both
    eager, rotary, x = llama_layer(GPU)
    compiled = copy.deepcopy(eager)
    assert compile_layers([compiled]) == 1
    outs = []
    for layer in (eager, compiled):
        xi = x.clone().requires_grad_()
        y = layer(xi, rotary, None)
        y.square().mean().backward()
        outs.append((y.detach(), xi.grad, [p.grad for p in layer.parameters()]))
    (ye, ge, pe), (yc, gc, pc) = outs
    torch.testing.assert_close(yc, ye, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gc, ge, rtol=1e-4, atol=1e-5)
    for a, b in zip(pc, pe):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
