"""tools/prepare_corpus.py: a JSONL corpus to a tokenizer and train/valid/test .bin/.idx held out by
document, on a small synthetic corpus."""

from __future__ import annotations

import gzip
import json
import os

import pytest

import prepare_corpus
from megatron_lsgd.core.datasets import IndexedDataset

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _corpus(path, n=40):
    docs = [f"document {i}: " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(30 + i)) for i in range(n)]
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d, "source": "test"}) + "\n")
    return docs


def test_splits_are_whole_documents_and_a_second_run_keeps_the_outputs(tmp_path, capsys):
    src = str(tmp_path / "in.jsonl.gz")
    docs = _corpus(src)
    out = str(tmp_path / "out")
    argv = ["--input", src, "--output-dir", out, "--name", "c", "--vocab-size", "300", "--heldout-every", "10",
            "--workers", "1"]
    prepare_corpus.main(argv)
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=os.path.join(out, "c_sp300.model"))
    expected = {"valid": [d for i, d in enumerate(docs) if i % 10 == 0],
                "test": [d for i, d in enumerate(docs) if i % 10 == 1],
                "train": [d for i, d in enumerate(docs) if i % 10 > 1]}
    for split, texts in expected.items():
        ds = IndexedDataset(os.path.join(out, f"c_{split}_text_document"))
        assert len(ds) == len(texts)
        # each sequence is one whole document, EOD appended (Megatron's id after the pieces)
        decoded = [sp.decode([int(t) for t in ds[i][:-1]]) for i in range(len(ds))]
        assert decoded == texts
    assert "training the tokenizer" in capsys.readouterr().out

    before = {f: os.path.getmtime(os.path.join(out, f)) for f in os.listdir(out)}
    prepare_corpus.main(argv)  # resumes: every step's outputs exist
    printed = capsys.readouterr().out
    assert printed.count("kept") == 5 and "training the tokenizer" not in printed
    assert before == {f: os.path.getmtime(os.path.join(out, f)) for f in os.listdir(out)}


@pytest.mark.parametrize("argv,message", [
    (["--heldout-every", "2"], "--heldout-every must be >= 3"),
    (["--tokenizer-text-bytes", "0"], "--tokenizer-text-bytes must be > 0"),
    (["--input", "missing.jsonl"], "--input missing.jsonl does not exist"),
])
def test_bad_input_is_one_error_line(tmp_path, capsys, argv, message):
    src = str(tmp_path / "in.jsonl.gz")
    _corpus(src, 5)
    base = ["--input", src, "--output-dir", str(tmp_path / "out"), "--vocab-size", "300"]
    with pytest.raises(SystemExit) as exc:
        prepare_corpus.main(base + argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("error:") == 1 and message in err and "Traceback" not in err


def test_a_damaged_line_is_named_and_nothing_is_left(tmp_path, capsys):
    src = str(tmp_path / "in.jsonl")
    with open(src, "w") as f:
        f.write(json.dumps({"text": "fine"}) + "\n{broken\n")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        prepare_corpus.main(["--input", src, "--output-dir", str(out), "--vocab-size", "300"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("error:") == 1 and ":2" in err
    assert os.listdir(out) == []  # no split file, no temporary directory
