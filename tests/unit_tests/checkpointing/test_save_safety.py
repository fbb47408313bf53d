"""Checkpoints are never destroyed, never silently wrong, and --save/--load mistakes stop
the run at start-up: exit code 2, one `error:` line naming the flag or file, nothing
changed on disk. In-process runs (world of one) except the lock holder."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from megatron_lsgd.training.checkpointing.lock import LOCK_NAME, SaveLock
from tests.unit_tests.checkpointing.launch import ROOT
from tests.unit_tests.checkpointing.single import run_single
from tests.unit_tests.harness import tree_digest

ITER = "iter_0000002"
MODEL_FILE = os.path.join(ITER, "mp_rank_00", "model_site_000.pt")


def _run(argv, monkeypatch, capsys):
    code = run_single(argv, monkeypatch)
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return code, out.out, out.err


# ---- checksums ------------------------------------------------------------------------------
def test_metadata_records_a_checksum_of_every_file(ckpt):
    meta = json.load(open(os.path.join(ckpt, ITER, "metadata.json")))
    assert set(meta["sha256"]) == set(meta["files"]) and len(meta["files"]) == 2
    assert meta["tokenizer"] == {"vocab_size": 250, "eod": 249, "bos": None}
    assert not os.path.exists(os.path.join(ckpt, LOCK_NAME))  # released at exit


def test_modified_weight_in_a_valid_file_is_refused(ckpt, monkeypatch, capsys):
    path = os.path.join(ckpt, MODEL_FILE)
    state = torch.load(path, weights_only=True)
    name = next(iter(state["params"]))
    state["params"][name].view(-1)[0] += 1.0  # same structure, same size: only the checksum can tell
    size = os.path.getsize(path)
    with open(path, "wb") as f:
        torch.save(state, f)
    assert os.path.getsize(path) == size
    before = tree_digest(ckpt)
    code, _, err = _run(["--train-iters", "3", "--load", ckpt], monkeypatch, capsys)
    assert code == 2
    assert f"error: checkpoint file {path} does not match the checksum" in err
    assert "--no-verify-checkpoint-checksums" in err
    assert tree_digest(ckpt) == before
    # The user may decide to load it anyway.
    code, out, _ = _run(["--train-iters", "3", "--load", ckpt, "--no-verify-checkpoint-checksums"],
                        monkeypatch, capsys)
    assert code == 0 and "loaded checkpoint" in out


# ---- --load ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["missing", "empty", "file"])
def test_load_that_holds_no_checkpoint_stops(tmp_path, monkeypatch, capsys, kind):
    target = tmp_path / "nothing_here"
    if kind == "empty":
        target.mkdir()
    elif kind == "file":
        target.write_text("x")
    before = tree_digest(str(tmp_path))
    code, out, err = _run(["--train-iters", "2", "--load", str(target)], monkeypatch, capsys)
    assert code == 2 and f"--load {target}" in err
    assert {"missing": "does not exist", "empty": "holds no checkpoint", "file": "is a file"}[kind] in err
    assert "starting from scratch" not in out
    assert tree_digest(str(tmp_path)) == before


def test_load_equal_to_save_starts_from_scratch(tmp_path, monkeypatch, capsys):
    run = str(tmp_path / "run")  # does not exist yet: the resume-or-start pattern
    code, out, _ = _run(["--train-iters", "2", "--load", run, "--save", run], monkeypatch, capsys)
    assert code == 0 and "starting from scratch" in out
    assert open(os.path.join(run, "latest_checkpointed_iteration.txt")).read() == "2"


# ---- --save checked at start-up -------------------------------------------------------------
def _read_only_dir(tmp_path) -> str:
    if os.geteuid() != 0:
        d = tmp_path / "ro"
        d.mkdir()
        d.chmod(0o555)
        return str(d / "ckpt")
    return "/sys/megatron_lsgd_ckpt"  # root ignores permission bits; sysfs refuses everyone


@pytest.mark.parametrize("kind", ["file", "inside_a_file", "read_only"])
def test_unusable_save_fails_before_training(tmp_path, monkeypatch, capsys, kind):
    if kind == "file":
        save = tmp_path / "ckpt"
        save.write_text("not a directory")
        save = str(save)
    elif kind == "inside_a_file":
        (tmp_path / "plain").write_text("x")
        save = str(tmp_path / "plain" / "ckpt")
    else:
        save = _read_only_dir(tmp_path)
    before = tree_digest(str(tmp_path))
    code, out, err = _run(["--train-iters", "2", "--save", save], monkeypatch, capsys)
    assert code == 2 and f"error: --save {save}" in err
    assert "iteration        1" not in out  # no training was spent
    assert tree_digest(str(tmp_path)) == before
    assert not os.path.exists(save) or kind == "file"


# ---- one run per save directory -------------------------------------------------------------
HOLDER = """
import sys, time
from megatron_lsgd.training.checkpointing.lock import SaveLock
lock = SaveLock(sys.argv[1])
lock.acquire()
print("locked", flush=True)
time.sleep(600)
"""


def _hold_lock(save: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, save], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_second_run_on_the_same_save_stops_and_a_dead_holder_is_stale(ckpt, monkeypatch, capsys):
    holder = _hold_lock(ckpt)
    try:
        before = tree_digest(ckpt)
        code, out, err = _run(["--train-iters", "4", "--load", ckpt, "--save", ckpt], monkeypatch, capsys)
        assert code == 2
        assert f"error: --save {ckpt} is in use by another run (pid {holder.pid} on host" in err
        assert "iteration        3" not in out
        assert tree_digest(ckpt) == before
    finally:
        holder.send_signal(signal.SIGKILL)  # dies without releasing: its lock file stays behind
        holder.wait()
    assert os.path.exists(os.path.join(ckpt, LOCK_NAME))
    code, out, _ = _run(["--train-iters", "4", "--load", ckpt, "--save", ckpt], monkeypatch, capsys)
    assert code == 0 and "iteration        4/" in out
    assert not os.path.exists(os.path.join(ckpt, LOCK_NAME))


def test_lock_without_flock_support_checks_the_recorded_holder(tmp_path, monkeypatch):
    import fcntl

    def no_flock(*_a):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    d = str(tmp_path / "ckpt")
    os.makedirs(d)
    path = os.path.join(d, LOCK_NAME)
    import socket

    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        json.dump({"host": socket.gethostname(), "pid": holder.pid}, open(path, "w"))
        with pytest.raises(Exception, match=f"in use by another run \\(pid {holder.pid}"):
            SaveLock(d).acquire()
    finally:
        holder.kill()
        holder.wait()
    lock = SaveLock(d)  # the recorded holder is dead: stale, taken over
    lock.acquire()
    assert json.load(open(path))["pid"] == os.getpid()
    lock.release()
    json.dump({"host": "elsewhere", "pid": 1}, open(path, "w"))
    with pytest.raises(Exception, match=f"delete {path}"):
        SaveLock(d).acquire()


# ---- disk full --------------------------------------------------------------------------------
def test_disk_full_during_a_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, capsys):
    save = str(tmp_path / "ckpt")
    real_save = torch.save

    def save_until_full(obj, f, *args, **kwargs):
        if ".iter_0000004.partial" in getattr(getattr(f, "_f", None), "name", ""):
            f.write(b"x" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_until_full)
    code, out, err = _run(["--train-iters", "6", "--save", save, "--save-interval", "2"], monkeypatch, capsys)
    assert code == 2
    assert f"saving the checkpoint of iteration 4 to {save} failed" in err and "disk is full" in err
    assert "saved checkpoint at iteration        2" in out and "iteration        5" not in out
    assert sorted(os.listdir(save)) == [ITER, "latest_checkpointed_iteration.txt"]  # no partial, no lock
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == "2"


# ---- divergence -------------------------------------------------------------------------------
def _all_finite(save_dir: str) -> bool:
    for dirpath, _d, files in os.walk(save_dir):
        for name in files:
            if name.startswith("model_site"):
                params = torch.load(os.path.join(dirpath, name), weights_only=True)["params"]
                if not all(torch.isfinite(t).all() for t in params.values()):
                    return False
    return True


def test_diverged_run_stops_before_saving_non_finite_weights(tmp_path, monkeypatch, capsys):
    save = str(tmp_path / "ckpt")
    code, out, err = _run(["--train-iters", "10", "--lr", "1e6", "--save", save, "--save-interval", "1"],
                          monkeypatch, capsys)
    assert code == 2
    assert "error: iteration " in err and "training diverged" in err and "nan" in err
    assert "iteration       10/" not in out
    assert _all_finite(save)


def test_without_the_check_a_non_finite_model_is_still_never_saved(tmp_path, monkeypatch, capsys):
    save = str(tmp_path / "ckpt")
    code, out, err = _run(["--train-iters", "10", "--lr", "1e6", "--save", save, "--save-interval", "1",
                           "--no-check-for-nan-in-loss-and-grad"], monkeypatch, capsys)
    assert code == 2 and "refusing to save a non-finite model" in err
    assert _all_finite(save)


# ---- validation position ----------------------------------------------------------------------
def _validation_losses(text: str):
    import re

    return dict(re.findall(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)", text))


def test_resume_restores_the_validation_position(tmp_path, monkeypatch, capsys):
    """A resumed run evaluates on the samples the uninterrupted run would have used next,
    so its validation losses are the same (not those of the first evaluation again)."""
    evals = ["--eval-interval", "2", "--eval-iters", "2", "--hidden-dropout", "0", "--attention-dropout", "0"]
    full = str(tmp_path / "full")
    code, out, _ = _run(["--train-iters", "4", "--save", full, "--save-interval", "2", *evals], monkeypatch, capsys)
    assert code == 0
    uninterrupted = _validation_losses(out)
    assert set(uninterrupted) == {"2", "4"} and uninterrupted["2"] != uninterrupted["4"]
    meta = json.load(open(os.path.join(full, ITER, "metadata.json")))
    assert meta["consumed_valid_samples"] == 2 * 2  # one evaluation of 2 iterations x global batch 2

    resumed = str(tmp_path / "resumed")
    os.makedirs(resumed)
    shutil.copytree(os.path.join(full, ITER), os.path.join(resumed, ITER))
    with open(os.path.join(resumed, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")
    code, out, _ = _run(["--train-iters", "4", "--load", resumed, "--save", resumed, *evals], monkeypatch, capsys)
    assert code == 0 and "loaded checkpoint" in out
    assert _validation_losses(out) == {"4": uninterrupted["4"]}
