"""--compile (core/transformer/compile.py): each transformer layer's forward compiled by
inductor (on CPU here) trains as the eager model does, within 1e-5 relative per logged loss over
20 steps, for TP 1, TP 2 with sequence parallelism, PP 2 (with selective recomputation and
evaluation) and every synchronizer (two sites,
the simulated clock so that a-edit, acco, dpu, dilocox and dreamddp decide the same way in
both runs), ZeRO-1 with full recomputation included; and the layers compile into graphs with
no graph break and no recompilation after the first step. One spawn runs every pair; the
compiled runs share inductor's on-disk cache, so only a few graphs are compiled cold."""

from __future__ import annotations

import pytest
import torch

from tests.unit_tests.harness import logged_losses, run_distributed_many
from tests.unit_tests.core.test_simulated_clock import ALGORITHMS as SIMULATED

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "5e-3", "--mock-data", "--vocab-size", "128",
        "--make-vocab-size-divisible-by", "32", "--log-interval", "1", "--eval-iters", "0", "--seed", "3",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear"]
STEPS = ["--train-iters", "20"]
SIM = ["--num-sites", "2", "--simulate-clock", "--simulate-inter-site-bandwidth", "20",
       "--simulate-inter-site-latency", "20", "--simulate-slow-ranks", "1", "--slow-factor", "2"]


def _without_length(args):  # the simulated-clock test's flags, less its --train-iters N
    i = args.index("--train-iters")
    return args[:i] + args[i + 2:]


ALGORITHM_ARGS = {name: _without_length(args) for name, args in SIMULATED.items() if name != "a-edit"}
CONFIGS = {
    "tp2-sp": STEPS + ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    # selective recomputation: its checkpoint inside the compiled layer; evaluation: eval-mode graphs
    "pp2-selective-eval": STEPS + ["--pipeline-model-parallel-size", "2", "--recompute-granularity", "selective",
                                   "--eval-iters", "1", "--eval-interval", "10"],
    **{name: STEPS + SIM + ["--lsgd-algorithm", name] + args for name, args in ALGORITHM_ARGS.items()},
    # a-edit ends by samples (its sites take their own steps): 20 global batches
    "a-edit": SIM + ["--lsgd-algorithm", "a-edit", "--train-samples", "160", "--lsgd-aedit-interval-seconds", "0.5"],
    "dp2-zero1-recompute": STEPS + ["--use-distributed-optimizer",
                                     "--recompute-granularity", "full", "--recompute-method", "uniform",
                                     "--recompute-num-layers", "1"],
}


def _relative(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.slow
def test_compiled_layers_train_as_the_eager_ones_in_every_layout_and_algorithm():
    argvs = []
    for flags in CONFIGS.values():
        argvs += [TINY + flags, TINY + flags + ["--compile"]]
    runs = run_distributed_many(argvs, 2)
    for i, name in enumerate(CONFIGS):
        eager, compiled = runs[2 * i], runs[2 * i + 1]
        want, got = logged_losses(eager), logged_losses(compiled)
        # a-edit logs at its meetings only
        assert len(got) == len(want) and len(want) >= (1 if name == "a-edit" else 20), (name, len(want), len(got))
        worst = max(_relative(g, w) for g, w in zip(got, want))
        assert worst <= 1e-5, (name, worst)
        valid_want, valid_got = eager[-1]["valid"], compiled[-1]["valid"]
        assert len(valid_want) == (2 if "eval" in name else 0), (name, valid_want)
        assert len(valid_got) == len(valid_want) and all(_relative(g, w) <= 1e-5 for g, w in zip(valid_got, valid_want))
        for record in compiled:
            counts = record["compile"]
            assert counts is not None and counts["warmup_graphs"] >= 1, (name, counts)  # it did compile
            assert counts["warmup_graph_breaks"] == 0 and counts["later_graph_breaks"] == 0, (name, counts)
            assert counts["recompilations"] == 0, (name, counts)
        assert all(record["compile"] is None for record in eager), name


def test_the_compile_line_is_said_once_after_the_step_that_follows_warm_up(monkeypatch):
    # dynamo's counters faked: 1 graph in the warm-up step, a recompilation (one more frame) in the next
    from collections import Counter, defaultdict

    from megatron_lsgd.core.transformer import compile as compile_module

    counters = defaultdict(Counter)
    monkeypatch.setattr(compile_module, "_counters", lambda: counters)
    report = compile_module.CompileReport(num_layers=3)
    counters["stats"]["unique_graphs"] += 1
    counters["frames"]["ok"] += 1
    assert report.after_step(1) is None  # the warm-up step just ended
    counters["frames"]["ok"] += 1
    counters["graph_break"]["Unsupported: a hook\nstack"] += 1
    line = report.after_step(2)
    assert line == ("compile: 3 layer(s) compiled; warm-up: 1 graph(s), 0 graph break(s); the step after it: "
                    "1 graph break(s), 1 recompilation(s) (breaks: Unsupported: a hook)")
    assert report.counts == {"warmup_graphs": 1, "warmup_graph_breaks": 0, "later_graph_breaks": 1,
                             "recompilations": 1}
    counters["frames"]["ok"] += 1
    assert report.after_step(3) is None and report.after_step(4) is None  # once


def llama_layer(device: torch.device, hidden: int = 128, seq: int = 64):
    """One Llama-style layer (RMSNorm, RoPE, GQA, SwiGLU), filled, with its rotary table and an input."""
    from megatron_lsgd.core.tensor_parallel.random import RNGStatesTracker
    from megatron_lsgd.core.transformer.attention import RotaryEmbedding
    from megatron_lsgd.core.transformer.config import TransformerConfig
    from megatron_lsgd.core.transformer.layer import TransformerLayer

    c = TransformerConfig(hidden_size=hidden, num_attention_heads=4, num_query_groups=2, seq_length=seq,
                          position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                          hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    layer = TransformerLayer(c, None, 1, RNGStatesTracker(device), 0).to(device)
    with torch.no_grad():  # (a layer allocates; the model's initializer fills it)
        for p in layer.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
            else:
                p.fill_(1.0)
    positions = torch.arange(seq, device=device)[None].expand(2, seq)
    rotary = RotaryEmbedding(c.rotary_dim, c.rotary_base).to(device)(positions)
    return layer, rotary, torch.randn(seq, 2, hidden, device=device)


def test_hooks_run_around_the_compiled_forward_never_inside_it(monkeypatch):
    # the unit hooks (a forward pre-hook, a gradient hook) run eagerly on every call, at the
    # layer's boundary; the forward itself is compiled (aot_eager here: where hooks run is the
    # question, not inductor's code)
    import functools

    from megatron_lsgd.core.transformer.compile import CompileCounts, compile_layers

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    layer, rotary, x = llama_layer(torch.device("cpu"), hidden=32, seq=8)
    before = CompileCounts.now()
    compile_layers([layer])
    seen = []
    layer.register_forward_pre_hook(lambda _m, _a: seen.append(("forward", torch.compiler.is_compiling())))
    weight = layer.mlp.linear_fc2.weight
    weight.register_post_accumulate_grad_hook(lambda _p: seen.append(("grad", torch.compiler.is_compiling())))
    for _ in range(3):
        layer(x, rotary, None).sum().backward()
    assert seen == [("forward", False), ("grad", False)] * 3
    assert (CompileCounts.now() - before).graphs == 1  # and the forward was compiled, once
