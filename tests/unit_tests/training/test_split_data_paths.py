"""Megatron's --train-data-path / --valid-data-path / --test-data-path (each split its own files,
used whole) and --skip-train (evaluate a checkpoint on held-out sets, train nothing). In-process
runs (a world of one) on the bundled corpus: its .bin/.idx stands in for each split's file."""

from __future__ import annotations

import os
import re

import pytest

from tests.unit_tests.checkpointing.launch import ROOT
from tests.unit_tests.checkpointing.single import run_single

DATA = os.path.join(ROOT, "data", "python-docs")
PREFIX = os.path.join(DATA, "python_docs_text_document")
MODEL = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
         "--micro-batch-size", "4", "--global-batch-size", "4", "--lr", "1e-3", "--log-interval", "2",
         "--seed", "3", "--tokenizer-type", "SentencePieceTokenizer",
         "--tokenizer-model", os.path.join(DATA, "python_docs_sp8k.model")]


def _run(argv, monkeypatch, capsys):
    code = run_single(argv, monkeypatch, base=MODEL)
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return code, out.out, out.err


def _loss(text, where):
    found = re.findall(rf"validation loss at iteration (\d+){where} \| lm loss value: ([0-9.E+-]+)", text)
    return [(int(i), float(v)) for i, v in found]


def test_each_split_from_its_own_files_and_a_checkpoint_evaluated_without_training(tmp_path, monkeypatch, capsys):
    save = str(tmp_path / "ckpt")
    code, out, err = _run(["--train-iters", "4", "--eval-interval", "4", "--eval-iters", "2",
                           "--train-data-path", PREFIX, "--valid-data-path", PREFIX, "--test-data-path", PREFIX,
                           "--save", save], monkeypatch, capsys)
    assert code == 0, err
    # the training file is used whole (no --split share): all of the bundled corpus's 1,373,154 tokens
    assert "> training data: 1,373,154 tokens in the train split" in out
    assert [i for i, _ in _loss(out, "")] == [4]
    (it, test_at_end), = _loss(out, " on test set")  # once, at the end, after the last validation
    assert it == 4 and out.index("on test set") > out.index("validation loss at iteration 4 |")

    # --skip-train: the saved model on the same test file, nothing trained, no length flag needed
    code, out, err = _run(["--skip-train", "--load", save, "--eval-iters", "2", "--valid-data-path", PREFIX,
                           "--test-data-path", PREFIX], monkeypatch, capsys)
    assert code == 0, err
    assert re.search(r"iteration +\d+/", out) is None and " saved checkpoint" not in out  # no step, no save
    assert _loss(out, " on test set") == [(4, test_at_end)]
    assert [i for i, _ in _loss(out, " on validation set")] == [4]

    # only a test set: the validation line is absent, the test line present
    code, out, err = _run(["--skip-train", "--load", save, "--eval-iters", "1", "--test-data-path", PREFIX],
                          monkeypatch, capsys)
    assert code == 0 and _loss(out, " on validation set") == [] and len(_loss(out, " on test set")) == 1, err


@pytest.mark.parametrize("argv,message", [
    (["--train-iters", "2", "--data-path", PREFIX, "--valid-data-path", PREFIX],
     "--data-path and --valid-data-path exclude each other"),
    (["--train-iters", "2", "--valid-data-path", PREFIX], "--valid-data-path is given without --train-data-path"),
    (["--train-iters", "2", "--mock-data", "--train-data-path", PREFIX], "--mock-data and --train-data-path"),
    (["--skip-train", "--train-data-path", PREFIX], "--skip-train evaluates the validation and test sets"),
    (["--skip-train", "--test-data-path", PREFIX, "--eval-iters", "0"], "--skip-train with --eval-iters 0"),
    (["--train-iters", "2", "--train-data-path", os.path.join(DATA, "nothing_here")], "nothing_here"),
])
def test_mistakes_are_one_error_line(monkeypatch, capsys, argv, message):
    code, _, err = _run(argv, monkeypatch, capsys)
    assert code == 2 and err.count("error:") == 1 and message in err, err
