"""Megatron-LM's flags, with Megatron's meaning: the example launch scripts for GPT-3 175B
and Llama 3 8B parse and build (what cannot be honoured is refused by name), the sample-
based schedule equals the iteration-based one where both apply, and each option does
what it says. In process, world of one, except where a layout needs more ranks (then only
build_config, which needs no processes)."""

from __future__ import annotations

import base64
import gc
import json
import os
import re

import pytest
import torch

from megatron_lsgd.core.optimizer.config import OptimizerConfig
from megatron_lsgd.core.optimizer.lr_scheduler import LRScheduler
from megatron_lsgd.training.arguments import build_config, parse_args
from megatron_lsgd.training.batch_schedule import BatchSchedule
from tests.unit_tests.checkpointing.launch import TINY
from tests.unit_tests.checkpointing.single import run_single

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3", "--mock-data", "--vocab-size", "128"]

# The flags of Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh (8 x 16 model
# parallel, 128 ranks), with our own paths; both batch-size ramps that script has used.
GPT3_175B = ["--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96", "--seq-length", "2048",
             "--max-position-embeddings", "2048", "--attention-backend", "auto",
             "--micro-batch-size", "1", "--global-batch-size", "1536", "--train-iters", "500000",
             "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--init-method-std", "0.006",
             "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5", "--lr-decay-style", "cosine", "--min-lr", "6.0e-6",
             "--lr-warmup-fraction", ".001", "--lr-decay-iters", "430000",
             "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
             "--data-path", "data/gpt3_text_document", "--vocab-file", "gpt2-vocab.json",
             "--merge-file", "gpt2-merges.txt", "--split", "949,50,1",
             "--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000", "--save", "ckpt",
             "--load", "ckpt", "--eval-iters", "10", "--tensorboard-dir", "tb"]
GPT3_RAMPS = [["--rampup-batch-size", "16", "16", "5859375"],
              ["--step-batch-size-schedule", "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"]]

# examples/llama/train_llama3_8b_h100_fp8.sh with mock data (8 ranks, TP 1).
LLAMA3_8B = ["--use-mcore-models", "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
             "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
             "--kv-channels", "128", "--seq-length", "8192", "--max-position-embeddings", "8192",
             "--position-embedding-type", "rope", "--rotary-base", "1000000", "--rotary-percent", "1.0",
             "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--swiglu", "--normalization", "RMSNorm",
             "--init-method-std", "0.0134", "--attention-backend", "fused", "--apply-layernorm-1p",
             "--untie-embeddings-and-output-weights", "--disable-bias-linear",
             "--micro-batch-size", "1", "--global-batch-size", "128", "--train-samples", "1953125000",
             "--lr-decay-samples", "1949218748", "--lr-warmup-samples", "3906252", "--lr", "0.00015",
             "--min-lr", "0.00001", "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5",
             "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1", "--adam-beta1", "0.9",
             "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion",
             "--calculate-per-token-loss", "--manual-gc", "--empty-unused-memory-level", "1",
             "--exit-duration-in-mins", "235",
             "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max",
             "--fp8-param-gather",
             "--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel",
             "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
             "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128256",
             "--data-cache-path", "cache", "--tiktoken-pattern", "v2", "--split", "99,1,0",
             "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1",
             "--log-interval", "1", "--eval-iters", "32", "--eval-interval", "100", "--save-interval", "1000",
             "--log-throughput", "--profile", "--profile-step-start", "4", "--profile-step-end", "6",
             "--ckpt-format", "torch_dist", "--distributed-timeout-minutes", "60", "--save", "ckpt", "--load", "ckpt",
             "--tensorboard-dir", "tb"]


def _without(argv, *flags_with_values):
    out, skip = [], 0
    for i, a in enumerate(argv):
        if skip:
            skip -= 1
            continue
        for flag, n in flags_with_values:
            if a == flag:
                skip = n
                break
        else:
            out.append(a)
    return out


def _replace(argv, flag, value):
    i = argv.index(flag)
    return argv[:i + 1] + [value] + argv[i + 2:]


# ---- the example scripts ----------------------------------------------------------------------
@pytest.mark.parametrize("ramp", GPT3_RAMPS)
def test_gpt3_175b_script_builds_with_megatron_meaning(tmp_path, monkeypatch, ramp):
    monkeypatch.chdir(tmp_path)
    c = build_config(parse_args(GPT3_175B + ramp), 128)
    assert (c.dims.tp, c.dims.pp, c.dims.dp) == (8, 16, 1)
    assert c.tokenizer.tokenizer_type == "GPT2BPETokenizer"  # a vocab + merges pair
    s = c.compat.batch_schedule
    assert s.global_batch_size(0) == 16 and s.final_global_batch_size == 1536 == c.training.global_batch_size
    # A varying batch moves the schedule by samples; iteration spans count final batches (Megatron).
    assert c.optimizer.lr_unit == "samples" and c.optimizer.lr_decay_iters == 430000 * 1536
    assert c.optimizer.lr_warmup_iters == pytest.approx(0.001 * 430000 * 1536)
    if ramp[0] == "--step-batch-size-schedule":  # thresholds in tokens of 2048
        at = 2_400_000_000 // 2048
        assert s.global_batch_size(at - 1) == 16 and s.global_batch_size(at) == 320


def test_llama3_8b_script_refuses_only_what_cannot_be_honoured(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="--fp8-format hybrid: fp8 training needs NVIDIA Transformer Engine"):
        build_config(parse_args(LLAMA3_8B), 8)
    no_fp8 = _without(LLAMA3_8B, ("--fp8-format", 1))
    with pytest.raises(ValueError, match="--grad-reduce-in-bf16: gradients are accumulated and reduced in fp32"):
        build_config(parse_args(no_fp8), 8)
    no_bf16_reduce = _without(no_fp8, ("--grad-reduce-in-bf16", 0))
    with pytest.raises(ValueError, match="--ckpt-format torch_dist: checkpoints are written in one format"):
        build_config(parse_args(no_bf16_reduce), 8)
    c = build_config(parse_args(_replace(no_bf16_reduce, "--ckpt-format", "torch")), 8)
    m, o, t = c.model, c.optimizer, c.training
    assert (m.apply_layernorm_1p, m.rotary_percent, m.attention_backend, m.calculate_per_token_loss) == \
        (True, 1.0, "fused", True)
    assert m.sequence_parallel is False  # TP 1: turned off with a warning, as Megatron does
    assert (o.lr_unit, o.lr_decay_iters, o.lr_warmup_iters) == ("samples", 1949218748, 3906252)
    assert (o.decoupled_lr, o.decoupled_min_lr) == (5.0e-4, 4.5e-5)
    assert t.train_iters == 1953125000 // 128 and t.exit_duration_in_mins == 235
    assert c.compat.manual_gc and c.compat.empty_unused_memory_level == 1 and c.compat.log_throughput
    assert (c.compat.profile, c.compat.profile_step_start, c.compat.profile_step_end) == (True, 4, 6)
    assert c.data.mmap_bin_files is False


@pytest.mark.parametrize("extra,message", [
    (["--context-parallel-size", "2"], "--context-parallel-size 2: context parallelism is not implemented"),
    (["--use-legacy-models"], "--use-legacy-models"),
    (["--ckpt-format", "zarr", "--save", "x"], "--ckpt-format zarr"),
    (["--reset-attention-mask", "--no-create-attention-mask-in-dataloader"], "--reset-attention-mask needs"),
    (["--overlap-param-gather"], "--overlap-param-gather needs --use-distributed-optimizer"),
    (["--profile"], "--profile writes torch profiler traces into --tensorboard-dir"),
    (["--decoupled-min-lr", "1e-5"], "--decoupled-min-lr needs --decoupled-lr"),
    (["--rotary-percent", "0.35", "--position-embedding-type", "rope"],
     "--rotary-percent 0.35 of head size 16 gives 5"),
    (["--rotary-percent", "1.5"], "--rotary-percent 1.5 must be in (0, 1]"),
    (["--lr-decay-samples", "100", "--lr-decay-iters", "4"], "give one of --lr-decay-iters and --lr-decay-samples"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "1"], "give one of --lr-warmup-fraction"),
    (["--rampup-batch-size", "2", "4", "8", "--global-batch-size", "8"], "must be START plus a whole number"),
    (["--rampup-batch-size", "3", "3", "8", "--global-batch-size", "6"],
     "global batch size 3 is not a positive multiple"),
    (["--step-batch-size-schedule", "0:3 1K:4"], "global batch size 3 is not a positive multiple"),
    (["--step-batch-size-schedule", "64:2"], "the schedule must start at 0 samples"),
])
def test_refused_or_inconsistent_flags_name_themselves(extra, message):
    with pytest.raises(ValueError) as err:
        build_config(parse_args(BASE + extra), 1)
    assert message in str(err.value)


def test_no_effect_flags_are_said_once(capsys):
    build_config(parse_args(BASE + ["--use-mcore-models", "--cross-entropy-loss-fusion", "--fp8-margin", "2"]), 1)
    err = capsys.readouterr().err
    assert err.count("note: accepted for Megatron compatibility, no effect here:") == 1
    assert "--use-mcore-models" in err and "--cross-entropy-loss-fusion" in err and "--fp8-margin" in err
    build_config(parse_args(BASE + ["--use-distributed-optimizer", "--overlap-param-gather"]), 1)
    assert "--overlap-param-gather (not overlapped here" in capsys.readouterr().err


# ---- sample-based schedules ---------------------------------------------------------------------
def _lrs(config: OptimizerConfig, steps: int, samples: int):
    s = LRScheduler(config)
    out = []
    for _ in range(steps):
        out.append(s.next_lr(samples))
        s.step(samples)
    return out


@pytest.mark.parametrize("style", ["linear", "cosine", "constant"])
def test_sample_schedule_equals_iteration_schedule_bit_for_bit(style):
    g = 48
    it = OptimizerConfig(lr=3e-4, min_lr=3e-5, lr_decay_style=style, lr_warmup_iters=7, lr_decay_iters=90)
    sa = OptimizerConfig(lr=3e-4, min_lr=3e-5, lr_decay_style=style, lr_warmup_iters=7 * g, lr_decay_iters=90 * g,
                         lr_unit="samples")
    assert _lrs(it, 100, g) == _lrs(sa, 100, g)


def _logged(text: str):
    return re.findall(r"iteration\s+(\d+)/.*?learning rate: ([0-9.E+-]+) \| global batch size:\s+(\d+) \| "
                      r"lm loss: ([0-9.E+-]+)", text)


# TINY (the in-process runs' base) warms up over 2 iterations; sample-based runs say it in samples.
NO_WARMUP = _without(TINY, ("--lr-warmup-iters", 1))


def _run(argv, monkeypatch, capsys, base=TINY):
    code = run_single(argv, monkeypatch, base=base)
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    return out.out


@pytest.mark.parametrize("iters,samples", [
    (["--train-iters", "6", "--lr-warmup-iters", "2", "--lr-decay-iters", "5"],
     ["--train-samples", "12", "--lr-warmup-samples", "4", "--lr-decay-samples", "10"]),
    (["--train-iters", "6", "--lr-warmup-fraction", "0.25", "--lr-decay-iters", "4"],
     ["--train-samples", "12", "--lr-warmup-fraction", "0.25", "--lr-decay-samples", "8"]),
])
def test_sample_based_run_equals_iteration_based_run(monkeypatch, capsys, iters, samples):
    """TINY's global batch is 2: the same run described in iterations and in samples logs the
    same learning rates and losses, iteration by iteration."""
    a = _logged(_run(iters, monkeypatch, capsys, base=NO_WARMUP))
    b = _logged(_run(samples, monkeypatch, capsys, base=NO_WARMUP))
    assert len(a) == 6 and a == b


def test_rampup_schedule_thresholds_match_the_definition():
    s = BatchSchedule.rampup(16, 16, 5859375, 1536, 16)
    n = (1536 - 16) // 16
    for consumed in (0, 1, 61034, 61035, 61036, 3_000_000, 5859375, 5859376, 10**9):
        expected = 1536 if consumed > 5859375 else 16 + (consumed * n // 5859375) * 16
        assert s.global_batch_size(consumed) == expected, consumed
    assert BatchSchedule.rampup(4, 4, 0, 12, 4).steps == [(0, 12)]


def test_step_schedule_parsing_and_iterations():
    s = BatchSchedule(BatchSchedule.parse_steps("0:2, 1K:4 2.5K:8", seq_length=None), 2, "--step-batch-size-schedule")
    assert s.steps == [(0, 2), (1000, 4), (2500, 8)]
    # 500 steps of 2 reach 1000; 375 of 4 reach 2500; then (3000 - 2500) // 8 = 62 of 8.
    assert s.iterations_for(3000) == 500 + 375 + 62
    assert BatchSchedule(BatchSchedule.parse_steps("0:6", None), 2).iterations_for(13) == 2
    with pytest.raises(ValueError, match="'x2' is not a number"):
        BatchSchedule.parse_steps("0:x2", None)


def test_rampup_run_grows_the_batch_and_counts_samples(monkeypatch, capsys):
    out = _run(["--rampup-batch-size", "2", "2", "8", "--global-batch-size", "6", "--train-samples", "30",
                "--lr-warmup-samples", "4"], monkeypatch, capsys, base=NO_WARMUP)
    logged = _logged(out)
    assert [int(x[2]) for x in logged] == [2, 2, 4, 6, 6, 6]
    assert "consumed samples:           26" in out


# ---- options -------------------------------------------------------------------------------------
@pytest.fixture
def trainer(monkeypatch):
    """A Trainer of a world of one, in process (torch.distributed initialized for it)."""
    import torch.distributed as dist

    from megatron_lsgd.training.initialize import free_port, init_distributed
    from megatron_lsgd.training.training import Trainer
    import pretrain_gpt

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    made = []

    def make(extra):
        device = init_distributed("gloo", 5)
        argv = BASE + ["--hidden-dropout", "0", "--attention-dropout", "0", "--global-batch-size", "6"] + extra
        made.append(Trainer(build_config(parse_args(argv), 1), pretrain_gpt.model_provider,
                            pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.forward_step, device))
        return made[-1]

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()


def _batches():
    g = torch.Generator().manual_seed(3)
    out = []
    for count in (64, 20, 5):  # loss tokens per micro-batch (of 2 x 32): uneven on purpose
        tokens = torch.randint(0, 128, (2, 32), generator=g)
        mask = torch.zeros(2 * 32)
        mask[torch.randperm(64, generator=g)[:count]] = 1.0
        out.append({"tokens": tokens, "labels": torch.roll(tokens, -1, 1), "loss_mask": mask.reshape(2, 32),
                    "position_ids": torch.arange(32).expand(2, 32)})
    return out


def _grads(trainer, batches):
    trainer.inner_step.zero_grads()
    trainer.inner_step.compute_grads(iter(batches))
    trainer.inner_step.reduce_in_site()
    return torch.cat([p.main_grad.reshape(-1).clone() for p in trainer.model.module.parameters()])


def test_per_token_loss_is_the_mean_over_the_steps_tokens(trainer):
    t = trainer(["--calculate-per-token-loss"])
    batches = _batches()
    got = _grads(t, batches)
    # Reference: one loss over every loss token of the step, straight through autograd.
    t.inner_step.zero_grads()
    model = t.model.module
    total = sum((model(b["tokens"], b["position_ids"], labels=b["labels"]) * b["loss_mask"]).sum() for b in batches)
    (total / sum(b["loss_mask"].sum() for b in batches)).backward()
    want = torch.cat([p.main_grad.reshape(-1).clone() for p in model.parameters()])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    t.config.model.calculate_per_token_loss = False  # per-micro-batch means weight the 5-token batch like the others
    assert not torch.allclose(_grads(t, batches), want, rtol=1e-3, atol=1e-6)


def test_decoupled_lr_goes_to_embedding_and_output_layer(trainer):
    t = trainer(["--decoupled-lr", "5e-3", "--decoupled-min-lr", "5e-4", "--untie-embeddings-and-output-weights",
                 "--lr-warmup-iters", "2"])
    _grads(t, _batches())
    t.inner_step.apply()
    names = {id(p): n for n, p in t.model.module.named_parameters()}
    groups = list(zip(t.optimizer.optimizer.param_groups, t.optimizer._group_kinds))
    assert {kind: group["lr"] for group, kind in groups} == {"default": 1e-3 / 2, "decoupled": 5e-3 / 2}  # step 1 of 2
    kind_of = {id(m): kind for group, kind in groups for m in group["params"]}
    decoupled = {names[id(pc.param)] for pc in t.optimizer.pieces if kind_of[id(pc.main)] == "decoupled"}
    assert decoupled == {"embedding.word_embeddings.weight", "output_layer.weight"}


def test_layernorm_1p_is_the_same_function_with_shifted_weights():
    from megatron_lsgd.core.transformer.config import TransformerConfig
    from megatron_lsgd.core.transformer.norm import build_norm

    for kind in ("LayerNorm", "RMSNorm"):
        plain, one_p = (build_norm(TransformerConfig(normalization=kind, apply_layernorm_1p=f)) for f in (False, True))
        with torch.no_grad():
            plain.weight.copy_(torch.randn(64))
            one_p.weight.copy_(plain.weight - 1)
            if kind == "LayerNorm":
                one_p.bias.copy_(plain.bias)
        x = torch.randn(3, 64)
        torch.testing.assert_close(one_p(x), plain(x))


def test_layernorm_1p_starts_at_zero_and_exports_as_plain_norm(tmp_path, monkeypatch):
    from megatron_lsgd.training.checkpointing.full_model import read_lsgd
    from megatron_lsgd.training.checkpointing.hf_mapping import to_hf
    from tests.unit_tests.checkpointing.single import LLAMA

    ckpt = str(tmp_path / "c")
    assert run_single(LLAMA + ["--apply-layernorm-1p", "--train-iters", "2", "--save", ckpt,
                               "--lr", "1e-9", "--min-lr", "0"], monkeypatch) == 0
    full = read_lsgd(ckpt)
    w = full.params["layers.0.input_layernorm.weight"]
    assert w.abs().max() < 1e-6  # initialized at 0 (two tiny steps)
    _, tensors = to_hf(full.params, full.config)
    torch.testing.assert_close(tensors["model.layers.0.input_layernorm.weight"], w + 1)


def test_rotary_percent_rotates_only_the_leading_channels():
    from megatron_lsgd.core.transformer.attention import RotaryEmbedding, apply_rotary

    x = torch.randn(5, 1, 2, 16)
    cos, sin = RotaryEmbedding(8, 10000.0)(torch.arange(5).unsqueeze(0))
    y = apply_rotary(x, cos, sin)
    assert torch.equal(y[..., 8:], x[..., 8:]) and not torch.allclose(y[..., :8], x[..., :8])
    torch.testing.assert_close(y[..., :8], apply_rotary(x[..., :8].contiguous(), cos, sin))  # an 8-channel head


def test_attention_backends_on_this_machine():
    from megatron_lsgd.core.transformer.config import TransformerConfig
    from megatron_lsgd.training.compat_runtime import check_attention_backend

    cpu = torch.device("cpu")
    check_attention_backend(TransformerConfig(attention_backend="unfused"), cpu)
    if not torch.cuda.is_available():  # cuDNN / memory-efficient kernels exist on GPUs only
        with pytest.raises(ValueError, match="--attention-backend fused: no such attention kernel for this run"):
            check_attention_backend(TransformerConfig(attention_backend="fused"), cpu)


def test_attention_backend_unfused_computes_the_same_model(monkeypatch, capsys):
    a = _logged(_run(["--train-iters", "3"], monkeypatch, capsys))
    b = _logged(_run(["--train-iters", "3", "--attention-backend", "unfused"], monkeypatch, capsys))
    assert [x[3] for x in a] == [x[3] for x in b]


def test_log_throughput_and_flop_count(monkeypatch, capsys):
    from megatron_lsgd.core.transformer.config import TransformerConfig
    from megatron_lsgd.training.compat_runtime import flops_per_sample

    c = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, seq_length=4, ffn_hidden_size=16)
    # per token: qkv 8*24, proj 8*8, mlp 8*16 + 16*8, attention 2*4*2*4 -> x2; output 8*10 x2; x3 fwd+bwd; x4 tokens
    layer = 2 * (8 * 24 + 8 * 8 + 8 * 16 + 16 * 8 + 2 * 4 * 2 * 4)
    assert flops_per_sample(c, 10) == 3 * (layer + 2 * 8 * 10) * 4
    out = _run(["--train-iters", "4", "--log-throughput"], monkeypatch, capsys)
    assert len(re.findall(r"throughput per GPU \(TFLOP/s/GPU\): [0-9.]+ \|", out)) == 4


def test_manual_gc_collects_only_when_told(monkeypatch, capsys):
    events = []

    def record(phase, info):
        # Only collections made while gc is off count: the first run in a process imports
        # modules lazily, and automatic collections (full ones too) happen before start-up.
        if phase == "start" and not gc.isenabled():
            events.append(info["generation"])

    gc.callbacks.append(record)
    try:
        _run(["--manual-gc", "--manual-gc-interval", "2", "--train-iters", "4"], monkeypatch, capsys)
    finally:
        gc.callbacks.remove(record)
    assert gc.isenabled()
    # the start-up collection (gc is turned off there), then iterations 2 and 4 only: full
    # collections, and nothing else while gc is off
    assert events == [2, 2, 2]


def test_profile_writes_a_trace(tmp_path, monkeypatch, capsys):
    tb = tmp_path / "tb"
    _run(["--train-iters", "4", "--profile", "--profile-step-start", "1", "--profile-step-end", "2",
          "--tensorboard-dir", str(tb)], monkeypatch, capsys)
    traces = [n for n in os.listdir(tb) if n.endswith(".pt.trace.json")]
    assert len(traces) == 1
    assert json.load(open(tb / traces[0]))["traceEvents"]


def test_no_mmap_bin_files_reads_the_same_tokens(tmp_path):
    import numpy as np

    from megatron_lsgd.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(tmp_path / "d.bin"), np.uint16)
    for n in (3, 7, 1):
        builder.add_document(np.arange(n, dtype=np.uint16))
    builder.finalize(str(tmp_path / "d.idx"))
    mapped, loaded = IndexedDataset(str(tmp_path / "d")), IndexedDataset(str(tmp_path / "d"), mmap=False)
    assert isinstance(mapped._bin, np.memmap) and not isinstance(loaded._bin, np.memmap)
    assert [loaded[i].tolist() for i in range(3)] == [mapped[i].tolist() for i in range(3)]


def test_empty_unused_memory_levels(monkeypatch):
    from megatron_lsgd.training import inner_step as module

    calls = []
    monkeypatch.setattr(module.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(module.torch.cuda, "empty_cache", lambda: calls.append(1))
    step = module.InnerStep.__new__(module.InnerStep)
    for level, expected in ((0, 0), (1, 1), (2, 2)):
        calls.clear()
        step.empty_unused_memory_level = level
        step._empty_cache(1)  # after compute_grads
        step._empty_cache(2)  # after apply
        assert len(calls) == expected


# ---- TikTokenizer ----------------------------------------------------------------------------
def _tiktoken_vocab(path, merges):
    entries = [{"rank": i, "token_bytes": base64.b64encode(bytes([i])).decode(), "token_str": chr(i)}
               for i in range(256)]
    for m in merges:
        entries.append({"rank": len(entries), "token_bytes": base64.b64encode(m).decode(), "token_str": m.decode()})
    path.write_text(json.dumps(entries))
    return str(path)


def test_tiktokenizer_ids_merges_and_patterns(tmp_path):
    from megatron_lsgd.training.tokenizer import TokenizerConfig, build_tokenizer

    vocab = _tiktoken_vocab(tmp_path / "v.json", [b"he", b"ll", b"hell", b"hello", b" w", b" wo", b"or", b"ld"])

    def tok(pattern):
        return build_tokenizer(TokenizerConfig(tokenizer_type="TikTokenizer", tokenizer_model=vocab,
                                               tiktoken_pattern=pattern, vocab_size=2000))

    v2 = tok("v2")
    ids = v2.tokenize("hello world")
    # hello = rank 259; " world": " w" (260) then " wo" (261) beat "or" (262); "ld" (263); 1000 specials first
    assert ids == [1259, 1261, ord("r") + 1000, 1263]
    assert v2.detokenize(ids) == "hello world" and v2.eod == 2 and v2.bos == 1 and v2.vocab_size == 2000
    # v2 splits CamelCase words, v1 does not
    assert v2.detokenize(v2.tokenize("HelloWorld")) == "HelloWorld"
    assert tok("v1")._split.findall("HelloWorld") == ["HelloWorld"]
    assert v2._split.findall("HelloWorld") == ["Hello", "World"]
    with pytest.raises(ValueError, match="must be the single byte 0"):
        bad = json.loads(open(vocab).read())
        bad[0]["token_bytes"] = base64.b64encode(b"x").decode()
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        build_tokenizer(TokenizerConfig(tokenizer_type="TikTokenizer", tokenizer_model=str(tmp_path / "bad.json"),
                                        vocab_size=2000))


def test_resume_in_the_middle_of_a_ramp_continues_it_exactly(tmp_path, monkeypatch, capsys):
    ramp = ["--rampup-batch-size", "2", "2", "8", "--global-batch-size", "6", "--train-samples", "30",
            "--lr-warmup-samples", "4", "--hidden-dropout", "0", "--attention-dropout", "0"]
    full = str(tmp_path / "full")
    whole = _logged(_run(ramp + ["--save", full, "--save-interval", "3"], monkeypatch, capsys, base=NO_WARMUP))
    resumed_dir = str(tmp_path / "resumed")
    os.makedirs(resumed_dir)
    import shutil

    shutil.copytree(os.path.join(full, "iter_0000003"), os.path.join(resumed_dir, "iter_0000003"))
    with open(os.path.join(resumed_dir, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")
    resumed = _logged(_run(ramp + ["--load", resumed_dir], monkeypatch, capsys, base=NO_WARMUP))
    assert [x[0] for x in resumed] == ["4", "5", "6"]
    assert resumed == whole[3:]  # batch sizes 6, 6, 6, learning rates and losses


def test_iteration_spans_with_a_sample_budget_count_global_batches():
    c = build_config(parse_args(_without(BASE, ("--train-iters", 1)) +
                                ["--train-samples", "40", "--lr-warmup-iters", "2", "--lr-decay-iters", "8"]), 1)
    assert (c.optimizer.lr_unit, c.optimizer.lr_warmup_iters, c.optimizer.lr_decay_iters) == ("samples", 4, 16)


def test_changing_the_schedule_unit_on_resume_is_refused(tmp_path, monkeypatch, capsys):
    ckpt = str(tmp_path / "c")
    _run(["--train-iters", "2", "--save", ckpt], monkeypatch, capsys, base=NO_WARMUP)
    code = run_single(["--train-samples", "8", "--load", ckpt], monkeypatch, base=NO_WARMUP)
    err = capsys.readouterr().err
    assert code == 2 and "the saved learning-rate schedule counts iterations, this run's counts samples" in err
    assert run_single(["--train-samples", "8", "--load", ckpt, "--no-load-optim", "--no-load-rng"], monkeypatch,
                      base=NO_WARMUP) == 0
