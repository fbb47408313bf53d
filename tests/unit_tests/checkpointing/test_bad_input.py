"""Every bad input from the issue gives a clear error naming what differs; nothing loads
partially. Runs are in-process, world of one."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from megatron_lsgd.training.checkpointing import CheckpointError
from megatron_lsgd.training.checkpointing.safe_io import check_plain, load_file
from tests.unit_tests.checkpointing.single import run_single

ITER = "iter_0000002"
RANK_DIR = os.path.join(ITER, "mp_rank_00")


def _load(ckpt, monkeypatch, capsys, *extra):
    code = run_single(["--train-iters", "3", "--load", ckpt, *extra], monkeypatch)
    captured = capsys.readouterr()
    _load.out = captured.out
    return code, captured.err


def test_resume_loads(ckpt, monkeypatch, capsys):
    code, _ = _load(ckpt, monkeypatch, capsys)
    assert code == 0
    assert "loaded checkpoint" in _load.out and "iteration 2, consumed samples 4" in _load.out
    assert "iteration        3/       3" in _load.out and "iteration        2/" not in _load.out


def test_different_tensor_parallel_layout(ckpt, monkeypatch, capsys, tmp_path):
    from tools.checkpoint.convert import main as convert

    tp2 = str(tmp_path / "tp2")
    assert convert(["--model-type", "GPT", "--loader", "lsgd", "--saver", "lsgd", "--load-dir", ckpt,
                    "--save-dir", tp2, "--target-tensor-parallel-size", "2"]) == 0
    code, err = _load(tp2, monkeypatch, capsys, "--no-load-optim", "--no-load-rng")
    assert code == 2
    assert "tensor-parallel size 2 x pipeline-parallel size 1" in err and "TP 1 x PP 1" in err
    assert "tools/checkpoint/convert.py" in err


def test_missing_tracker(ckpt, monkeypatch, capsys):
    os.remove(os.path.join(ckpt, "latest_checkpointed_iteration.txt"))
    code, err = _load(ckpt, monkeypatch, capsys)
    assert code == 2 and "latest_checkpointed_iteration.txt is missing" in err and ITER in err


def test_unreadable_tracker(ckpt, monkeypatch, capsys):
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("\x00garbage")
    code, err = _load(ckpt, monkeypatch, capsys)
    assert code == 2 and "should hold an iteration number" in err


def test_tracker_names_missing_iteration(ckpt, monkeypatch, capsys):
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("7")
    code, err = _load(ckpt, monkeypatch, capsys)
    assert code == 2 and "iter_0000007, which does not exist" in err


def test_missing_rank_file(ckpt, monkeypatch, capsys):
    os.remove(os.path.join(ckpt, RANK_DIR, "rank_site_000_dp_000.pt"))
    code, err = _load(ckpt, monkeypatch, capsys)
    assert code == 2 and "rank_site_000_dp_000.pt is missing" in err


def test_truncated_file(ckpt, monkeypatch, capsys):
    path = os.path.join(ckpt, RANK_DIR, "model_site_000.pt")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    code, err = _load(ckpt, monkeypatch, capsys)
    assert code == 2 and "truncated" in err and f"{size // 2} bytes" in err


def test_corrupt_file_without_recorded_size(ckpt):
    path = os.path.join(ckpt, RANK_DIR, "model_site_000.pt")
    with open(path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match="unreadable"):
        load_file(path)


def test_model_config_disagrees(ckpt, monkeypatch, capsys):
    code, err = _load(ckpt, monkeypatch, capsys, "--hidden-size", "32", "--ffn-hidden-size", "256")
    assert code == 2
    assert "hidden_size (--hidden-size): checkpoint 64, this run 32" in err
    assert "ffn_hidden_size" not in err  # 4 x 64 == 256: only real differences are listed


def test_model_only_checkpoint_needs_explicit_flags(ckpt, monkeypatch, capsys, tmp_path):
    from tools.checkpoint.convert import main as convert

    out = str(tmp_path / "converted")
    assert convert(["--model-type", "GPT", "--loader", "lsgd", "--saver", "lsgd", "--load-dir", ckpt,
                    "--save-dir", out, "--model-only"]) == 0
    code, err = _load(out, monkeypatch, capsys)
    assert code == 2 and "holds no optimizer state" in err and "--no-load-optim" in err
    code, _ = _load(out, monkeypatch, capsys, "--no-load-optim", "--no-load-rng")
    assert code == 0


def test_different_data_parallel_layout_needs_model_only_load(ckpt, monkeypatch, capsys):
    import json

    meta_path = os.path.join(ckpt, ITER, "metadata.json")
    meta = json.load(open(meta_path))
    meta["layout"]["sites"] = 2  # as if saved by a two-site run
    json.dump(meta, open(meta_path, "w"))
    code, err = _load(ckpt, monkeypatch, capsys)
    assert code == 2 and "per site x 2 sites" in err and "--no-load-optim --no-load-rng" in err


def test_empty_or_interrupted_directory_starts_from_scratch(tmp_path, monkeypatch, capsys):
    os.makedirs(tmp_path / "run" / ".iter_0000002.partial")  # a first save that was killed
    code = run_single(["--train-iters", "2", "--load", str(tmp_path / "run"), "--save", str(tmp_path / "run")],
                      monkeypatch)
    assert code == 0 and "starting from scratch" in capsys.readouterr().out
    assert open(tmp_path / "run" / "latest_checkpointed_iteration.txt").read() == "2"
    assert not os.path.exists(tmp_path / "run" / ".iter_0000002.partial")


@dataclasses.dataclass
class _Anchor:
    value: float


def test_pickled_objects_are_refused_at_save_and_load(tmp_path):
    with pytest.raises(CheckpointError, match=r"state\['anchors'\]\[0\] is a .*_Anchor"):
        check_plain({"anchors": [_Anchor(1.0)]}, "state")
    path = str(tmp_path / "evil.pt")
    torch.save({"x": _Anchor(1.0)}, path)  # what weights_only=True exists to refuse
    with pytest.raises(CheckpointError, match=r"evil.pt is not a valid checkpoint: it holds a pickled Python "
                                              r"object \(tests.unit_tests.checkpointing.test_bad_input._Anchor\)") as err:
        load_file(path)
    assert "weights_only" not in str(err.value)  # never advise loading it anyway


def test_a_refused_resume_names_the_flag_that_differs(ckpt, monkeypatch, capsys):
    """An optimizer changed between save and resume is named as such (it was reported as a
    possible --ddp-bucket-size mismatch)."""
    code, err = _load(ckpt, monkeypatch, capsys, "--optimizer", "sgd")
    assert code == 2 and "--optimizer adam, this run has --optimizer sgd" in err and "bucket" not in err, err
    assert "--no-load-optim" in err

