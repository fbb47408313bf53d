"""tools/checkpoint/convert.py never writes over its source or over other data, and every
mistake ends with exit code 2 and `error: ...` naming the flag or file (no traceback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_lsgd.training.checkpointing.lock import SaveLock
from tests.unit_tests.checkpointing.launch import ROOT
from tests.unit_tests.harness import tree_digest


def _convert(capsys, *args):
    from tools.checkpoint.convert import main

    code = main(["--model-type", "GPT", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _lsgd(src, dst, *extra):
    return ["--loader", "lsgd", "--saver", "lsgd", "--load-dir", src, "--save-dir", dst, *extra]


@pytest.mark.parametrize("where", ["same", "inside"])
def test_target_equal_to_or_inside_the_source_is_refused(ckpt, capsys, where):
    dst = ckpt if where == "same" else os.path.join(ckpt, "converted")
    before = tree_digest(ckpt)
    code, _, err = _convert(capsys, *_lsgd(ckpt, dst, "--overwrite"))
    assert code == 2 and f"error: --save-dir {dst}" in err
    assert ("is --load-dir" if where == "same" else "is inside --load-dir") in err
    assert tree_digest(ckpt) == before


def test_source_inside_the_target_is_refused(ckpt, tmp_path, capsys):
    """The hf saver replaces its target directory: with the source inside it, that would delete the source."""
    outer = str(tmp_path)
    before = tree_digest(ckpt)
    code, _, err = _convert(capsys, "--loader", "lsgd", "--saver", "hf", "--load-dir", ckpt, "--save-dir", outer,
                            "--overwrite")
    assert code == 2 and f"--load-dir {ckpt} is inside --save-dir {outer}" in err
    assert tree_digest(ckpt) == before


def test_non_empty_target_needs_overwrite(ckpt, tmp_path, capsys):
    dst = tmp_path / "other"
    dst.mkdir()
    (dst / "notes.txt").write_text("keep me")
    before = tree_digest(str(dst))
    code, _, err = _convert(capsys, *_lsgd(ckpt, str(dst)))
    assert code == 2 and f"--save-dir {dst} is not empty (it holds notes.txt)" in err and "--overwrite" in err
    assert tree_digest(str(dst)) == before
    code, out, _ = _convert(capsys, *_lsgd(ckpt, str(dst), "--overwrite"))
    assert code == 0 and (dst / "notes.txt").read_text() == "keep me"
    assert (dst / "latest_checkpointed_iteration.txt").read_text() == "2"


def test_target_that_is_a_file_is_refused(ckpt, tmp_path, capsys):
    dst = tmp_path / "file"
    dst.write_text("x")
    code, _, err = _convert(capsys, *_lsgd(ckpt, str(dst), "--overwrite"))
    assert code == 2 and f"--save-dir {dst} is a file" in err and dst.read_text() == "x"


def test_target_used_by_a_running_training_is_refused(ckpt, tmp_path, capsys):
    dst = str(tmp_path / "live")
    os.makedirs(dst)
    lock = SaveLock(dst)  # what a training run saving to `dst` holds
    lock.acquire()
    try:
        code, _, err = _convert(capsys, *_lsgd(ckpt, dst, "--overwrite"))
    finally:
        lock.release()
    assert code == 2 and f"--save-dir {dst} is in use by another run (pid {os.getpid()}" in err
    assert not os.path.exists(os.path.join(dst, "latest_checkpointed_iteration.txt"))


@pytest.mark.parametrize("tp,pp,message", [
    ("3", "1", "cannot split the model for --target-tensor-parallel-size 3 x --target-pipeline-parallel-size 1: "
               "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3"),
    ("0", "1", "--target-tensor-parallel-size and --target-pipeline-parallel-size must be >= 1"),
    ("1", "3", "--num-layers 2 is not divisible by --pipeline-model-parallel-size 3"),
])
def test_impossible_target_layout_is_a_message(ckpt, tmp_path, capsys, tp, pp, message):
    dst = str(tmp_path / "out")
    code, _, err = _convert(capsys, *_lsgd(ckpt, dst, "--target-tensor-parallel-size", tp,
                                           "--target-pipeline-parallel-size", pp))
    assert code == 2 and message in err
    assert not os.path.exists(dst)


def test_missing_source_is_a_message(tmp_path, capsys):
    code, _, err = _convert(capsys, *_lsgd(str(tmp_path / "nope"), str(tmp_path / "out")))
    assert code == 2 and "no checkpoint in" in err and str(tmp_path / "nope") in err


def test_conversion_says_what_is_converted_and_what_is_dropped(ckpt, tmp_path, capsys):
    code, out, _ = _convert(capsys, *_lsgd(ckpt, str(tmp_path / "full")))
    assert code == 0
    assert "the optimizer state (Adam moments, step counts, fp32 main weights, loss scale), the LR schedule" in out
    assert "RNG states are not converted: resume with --no-load-rng" in out
    code, out, _ = _convert(capsys, *_lsgd(ckpt, str(tmp_path / "weights"), "--model-only"))
    assert code == 0
    assert "optimizer state (Adam moments, fp32 main weights, loss scale)" in out and "not converted" in out
    assert "--no-load-optim --no-load-rng" in out


def test_command_line_errors_exit_2_without_traceback(tmp_path):
    """The real entry point, as a user runs it."""
    out = subprocess.run([sys.executable, "tools/checkpoint/convert.py", "--model-type", "GPT", "--loader", "lsgd",
                          "--saver", "lsgd", "--load-dir", str(tmp_path), "--save-dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.startswith("error: --save-dir") and "Traceback" not in out.stderr


def test_hf_import_with_heads_that_do_not_divide_is_a_message(tmp_path, capsys):
    from safetensors.torch import save_file
    import torch

    hf = tmp_path / "hf"
    hf.mkdir()
    cfg = {"model_type": "llama", "hidden_size": 66, "num_attention_heads": 4, "num_key_value_heads": 4,
           "intermediate_size": 96, "num_hidden_layers": 1, "max_position_embeddings": 32, "vocab_size": 64}
    (hf / "config.json").write_text(json.dumps(cfg))
    save_file({"model.embed_tokens.weight": torch.zeros(64, 66)}, str(hf / "model.safetensors"))
    code, _, err = _convert(capsys, "--loader", "hf", "--saver", "lsgd", "--load-dir", str(hf),
                            "--save-dir", str(tmp_path / "out"))
    assert code == 2
    assert "config.json: hidden_size 66 is not divisible by num_attention_heads 4 and no head_dim is given" in err
    cfg.update(hidden_size=64, num_key_value_heads=3)
    (hf / "config.json").write_text(json.dumps(cfg))
    code, _, err = _convert(capsys, "--loader", "hf", "--saver", "lsgd", "--load-dir", str(hf),
                            "--save-dir", str(tmp_path / "out"))
    assert code == 2 and "num_attention_heads 4 is not a multiple of num_key_value_heads 3" in err
