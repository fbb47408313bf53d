"""A full disk during any write: one `error:` line naming the file, exit code 2, nothing
half-written left behind, earlier output intact. The disk fills up for real in the kernel:
`no_room_for_files` (RLIMIT_FSIZE, EFBIG) or /dev/full (ENOSPC), no mocked writes."""

from __future__ import annotations

import json
import os
import sys

import pytest

from megatron_lsgd.training import training
from tests.unit_tests.checkpointing.launch import ROOT
from tests.unit_tests.checkpointing.single import run_single
from tests.unit_tests.harness import no_room_for_files, tree_digest

sys.path.insert(0, os.path.join(ROOT, "tools"))
import preprocess_data  # noqa: E402


def _run(argv, monkeypatch, capsys):
    code = run_single(argv, monkeypatch)
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return code, out.out, out.err


def test_checkpoint_save_on_a_full_disk_names_the_file_and_keeps_the_previous_one(tmp_path, monkeypatch, capsys):
    """torch's zip writer turns the failed write into `RuntimeError: unexpected pos`; the
    OSError under it is what the user sees."""
    save = str(tmp_path / "ckpt")
    real_save = training.save_checkpoint

    def disk_full_at_iteration_4(trainer, cfg):
        if trainer.position.iteration != 4:
            return real_save(trainer, cfg)
        with no_room_for_files():
            return real_save(trainer, cfg)

    monkeypatch.setattr(training, "save_checkpoint", disk_full_at_iteration_4)
    code, out, err = _run(["--train-iters", "6", "--save", save, "--save-interval", "2"], monkeypatch, capsys)
    assert code == 2
    partial = os.path.join(save, ".iter_0000004.partial")
    assert err.count("error:") == 1
    assert f"error: saving the checkpoint of iteration 4 to {save} failed: cannot write {partial}/" in err
    assert "[Errno 27] File too large (the disk is full or a size limit was reached" in err
    assert "saved checkpoint at iteration        2" in out and "iteration        5" not in out
    assert sorted(os.listdir(save)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]  # no partial, no lock
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == "2"


def test_json_log_on_a_full_device(monkeypatch, capsys):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    code, out, err = _run(["--train-iters", "3", "--json-log", "/dev/full"], monkeypatch, capsys)
    assert code == 2 and "iteration        2/" not in out
    assert err.count("error:") == 1
    assert "error: cannot write --json-log /dev/full: [Errno 28] No space left on device (the disk is full" in err


@pytest.mark.parametrize("room", [0, 64 * 1024])
def test_hf_export_on_a_full_disk_leaves_no_partial_directory(ckpt, tmp_path, capsys, room):
    """room 0: config.json fails (Python's OSError); 64 KB: config.json is written and the
    disk fills under the safetensors writer, whose error (`SafetensorError`) is no OSError."""
    from tools.checkpoint.convert import main

    target = str(tmp_path / "hf")
    with no_room_for_files(room):
        code = main(["--model-type", "GPT", "--loader", "lsgd", "--saver", "hf", "--load-dir", ckpt,
                     "--save-dir", target])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert f"error: cannot write the Hugging Face export {target}.partial: [Errno 27] File too large" in err
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # neither hf/ nor hf.partial/


@pytest.mark.parametrize("runtime", [[], ["--workers", "2"], ["--partitions", "2"]])
def test_preprocessing_on_a_full_disk_names_the_output_and_keeps_the_old_one(tmp_path, capsys, runtime):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": " ".join(str(i % 900) for i in range(k, k + 300))}) + "\n"
                           for k in range(200)))
    out = str(tmp_path / "c")
    argv = ["--input", str(src), "--output-prefix", out, "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
            "--overwrite", *runtime]
    preprocess_data.main(argv)
    capsys.readouterr()
    before = tree_digest(str(tmp_path))
    with no_room_for_files(4096), pytest.raises(SystemExit) as exc:
        preprocess_data.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err
    assert "error: cannot write " in err and "(the disk is full or a size limit was reached" in err
    assert f"{out}_text_document.bin" in err or f"{out}_part" in err  # the output, not a temporary name
    assert ".tmp." not in err
    assert tree_digest(str(tmp_path)) == before  # the previous output as it was, no temporary file left


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # no raw thread traceback
def test_tensorboard_on_a_full_disk_names_the_directory(tmp_path, monkeypatch, capsys):
    """tensorboard writes its event file from a thread and hands the OSError to the next call:
    one line naming --tensorboard-dir, exit 2 (the event file is a log: it is kept)."""
    import threading

    hook = threading.excepthook
    ok = tmp_path / "tb-ok"
    assert _run(["--train-iters", "2", "--tensorboard-dir", str(ok), "--log-interval", "1"], monkeypatch, capsys)[0] == 0
    assert [n for n in os.listdir(ok) if n.startswith("events.out.tfevents")] and threading.excepthook is hook
    tb = str(tmp_path / "tb")
    with no_room_for_files(0):
        code, out, err = _run(["--train-iters", "4", "--tensorboard-dir", tb, "--log-interval", "1"],
                              monkeypatch, capsys)
    assert code == 2 and err.count("error:") == 1, err
    assert f"cannot write --tensorboard-dir {tb}: [Errno 27] File too large (the disk is full" in err
