"""Bad arguments fail at start with a message naming the flag and the fix."""

import os
import subprocess
import sys

import pytest

from megatron_lsgd.training.arguments import build_config, parse_args

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3", "--mock-data", "--vocab-size", "128"]


def config(extra, world=1):
    return build_config(parse_args(BASE + extra), world)


def test_defaults_build():
    c = config([], world=4)
    assert c.dims.dp == 4 and c.training.global_batch_size == 8 and c.num_microbatches == 1
    assert c.optimizer.lr_decay_iters == 4


@pytest.mark.parametrize("extra,world,message", [
    (["--tensor-model-parallel-size", "3"], 3, "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3"),
    (["--pipeline-model-parallel-size", "3"], 3, "--num-layers 2 is not divisible by --pipeline-model-parallel-size 3"),
    (["--tensor-model-parallel-size", "2"], 3, "world size 3 is not divisible"),
    (["--num-sites", "2"], 3, "--num-sites 2"),
    (["--global-batch-size", "6"], 4, "--global-batch-size 6 is not divisible by --micro-batch-size 2"),
    (["--group-query-attention", "--num-query-groups", "3"], 1, "--num-query-groups 3"),
    (["--group-query-attention", "--num-query-groups", "4", "--tensor-model-parallel-size", "8",
      "--num-attention-heads", "8"], 8, "--num-query-groups 4 is not divisible by --tensor-model-parallel-size 8"),
    (["--bf16", "--fp16"], 1, "mutually exclusive"),
    (["--lr-warmup-iters", "10", "--lr-decay-iters", "5"], 1, "--lr-decay-iters 5 is shorter"),
    (["--lr", "0"], 1, "--lr must be > 0"),
    (["--hidden-dropout", "1.5"], 1, "--hidden-dropout"),
    (["--position-embedding-type", "learned_absolute", "--max-position-embeddings", "16"], 1,
     "--seq-length 32 exceeds --max-position-embeddings 16"),
    (["--split", "90,x,1"], 1, "--split"),
    # Validated as the user gave them, not after defaults were derived from them.
    (["--hidden-size", "66"], 1, "--hidden-size 66 is not divisible by --num-attention-heads 4"),
    (["--kv-channels", "0"], 1, "--kv-channels must be >= 1 (got 0)"),
    (["--ffn-hidden-size", "0"], 1, "--ffn-hidden-size must be >= 1"),
    (["--global-batch-size", "0"], 1, "--global-batch-size must be >= 1 (got 0)"),
    (["--global-batch-size", "-4"], 1, "--global-batch-size must be >= 1 (got -4)"),
    (["--norm-epsilon", "0"], 1, "--norm-epsilon must be > 0"),
    (["--vocab-size", "-3"], 1, "--vocab-size must be >= 2"),
    (["--fp16", "--loss-scale", "0"], 1, "--loss-scale 0.0 must be > 0"),
    (["--loss-scale-window", "0"], 1, "--loss-scale-window and --hysteresis must be >= 1"),
    (["--muon-momentum", "0.9"], 1, "--muon-momentum and --muon-ns-steps need --optimizer muon"),
    (["--optimizer", "muon", "--muon-momentum", "1.0"], 1, "--muon-momentum must be in [0, 1)"),
    (["--optimizer", "muon", "--muon-ns-steps", "0"], 1, "--muon-ns-steps must be in [1, 50]"),
])
def test_bad_arguments_name_the_flag(extra, world, message):
    with pytest.raises(ValueError) as err:
        config(extra, world)
    assert message in str(err.value)


def test_null_tokenizer_needs_vocab_size():
    args = [a for a in BASE if a not in ("--vocab-size", "128")]
    with pytest.raises(ValueError, match="--vocab-size"):
        build_config(parse_args(args), 1)


def test_pretrain_exits_with_message(tmp_path):
    """The real entry point prints the error and exits 2 instead of a traceback."""
    out = subprocess.run([sys.executable, "pretrain_gpt.py"] + BASE + ["--global-batch-size", "3"],
                         capture_output=True, text=True, timeout=120,
                         cwd=__file__.rsplit("/tests/", 1)[0])
    assert out.returncode == 2
    assert "error: --global-batch-size 3 is not divisible" in out.stderr
    assert "Traceback" not in out.stderr


def test_hidden_size_with_explicit_kv_channels_builds():
    c = config(["--hidden-size", "66", "--kv-channels", "16"])
    assert c.model.kv_channels == 16


@pytest.mark.parametrize("flag,kind,message", [
    ("--json-log", "dir", "is a directory; give a file path"),
    ("--tensorboard-dir", "file", "is a file; give a directory"),
    ("--data-cache-path", "file", "is a file; give a directory"),
    ("--json-log", "under_file", "cannot be created"),
])
def test_output_paths_are_checked_before_the_run(tmp_path, flag, kind, message):
    target = tmp_path / "x"
    if kind == "dir":
        target.mkdir()
    elif kind == "file":
        target.write_text("")
    else:
        target.write_text("")
        target = target / "log.jsonl"
    with pytest.raises(ValueError) as err:
        config([flag, str(target)])
    assert f"{flag} {target}" in str(err.value) and message in str(err.value)


def test_sequence_parallel_without_tensor_parallel_is_turned_off_with_a_warning(capsys):
    c = config(["--sequence-parallel"])  # Megatron's Llama 3 8B script passes it with TP 1
    assert c.model.sequence_parallel is False
    assert "--sequence-parallel has no effect with --tensor-model-parallel-size 1" in capsys.readouterr().err


def test_help_reads_well():
    """--help: every model flag is described, each default is shown once (none for flags
    without one), the streaming fragment flags form their own group, tool descriptions
    keep their example commands on lines of their own (no runs of spaces)."""
    import re
    import sys

    from megatron_lsgd.training.arguments import build_parser

    parser = build_parser()
    text = parser.format_help()
    assert not [line for line in text.splitlines() if line.count("default") > 1]
    assert "(default: None)" not in text and "(default: False)" not in text
    groups = {g.title: [a.option_strings[0] for a in g._group_actions] for g in parser._action_groups}
    assert all(a.help for g in parser._action_groups if g.title == "model" for a in g._group_actions)
    fragments = groups["streaming fragments (--lsgd-algorithm cocodc or streaming-diloco)"]
    assert "--lsgd-fragments" in fragments and "--lsgd-fragments" not in groups["cocodc (--lsgd-algorithm cocodc)"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sys.path.insert(0, os.path.join(root, "tools"))
    import preprocess_data

    description = preprocess_data.build_parser().format_help().split("options:")[0]
    assert not re.search(r"\S {3,}\S", description), description
