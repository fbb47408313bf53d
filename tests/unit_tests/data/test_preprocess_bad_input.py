"""tools/preprocess_data.py on bad input: exit code 2 and `error: ...` naming the file (and
line), no traceback, no output written, an existing output and the input unchanged."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pytest

import preprocess_data
from datatest_utils import REPO_ROOT
from megatron_lsgd.core.datasets import IndexedDataset
from tests.unit_tests.harness import tree_digest

NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]
RUNTIME = [[], ["--workers", "2"], ["--partitions", "2"]]


def _jsonl_gz(path, texts):
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return str(path)


def _fail(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        preprocess_data.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("runtime", RUNTIME)
@pytest.mark.parametrize("content", ["", "{bad\n[1]\n", json.dumps({"text": ""}) + "\n"])
def test_input_without_documents_fails_and_writes_nothing(tmp_path, capsys, content, runtime):
    src = tmp_path / "in.jsonl"
    src.write_text(content)
    out = tmp_path / "out" / "corpus"
    err = _fail(capsys, ["--input", str(src), "--output-prefix", str(out), *NULL, *runtime])
    assert f"error: {src}: no documents to write" in err and "nothing was written" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("runtime", RUNTIME)
def test_truncated_gzip_names_the_file(tmp_path, capsys, runtime):
    src = _jsonl_gz(tmp_path / "in.jsonl.gz", [" ".join(str(i) for i in range(k % 50)) for k in range(4000)])
    data = open(src, "rb").read()
    with open(src, "wb") as f:
        f.write(data[: len(data) // 2])
    before = tree_digest(str(tmp_path))
    err = _fail(capsys, ["--input", src, "--output-prefix", str(tmp_path / "out" / "c"), *NULL, *runtime])
    assert f"error: {src}: truncated or corrupt gzip data after line" in err
    assert tree_digest(str(tmp_path)) == before  # the input as it was, no output


def test_not_gzip_despite_the_name(tmp_path, capsys):
    src = tmp_path / "in.jsonl.gz"
    src.write_text(json.dumps({"text": "1 2"}) + "\n")
    err = _fail(capsys, ["--input", str(src), "--output-prefix", str(tmp_path / "c"), *NULL])
    assert f"{src}: truncated or corrupt gzip data after line 0" in err


@pytest.mark.parametrize("workers", ["1", "2"])
def test_non_utf8_line_is_a_bad_line_with_its_position(tmp_path, capsys, workers):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"text": "1 2"}\n{"text": "3 \xff 4"}\n{"text": "5"}\n')
    out = str(tmp_path / "c")
    stats = preprocess_data.main(["--input", str(src), "--output-prefix", out, "--workers", workers, *NULL])
    assert (stats.documents, stats.bad_lines) == (2, 1)
    assert f"{src}:2: not valid UTF-8 (byte 0xff at column 13)" in capsys.readouterr().err
    ds = IndexedDataset(out + "_text_document")
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2], [5]]
    err = _fail(capsys, ["--input", str(src), "--output-prefix", str(tmp_path / "strict"), "--strict", *NULL])
    assert f"error: {src}:2: not valid UTF-8" in err


def test_failed_run_leaves_an_existing_output_untouched(tmp_path, capsys):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"text": "1 2 3"}) + "\n")
    out = str(tmp_path / "c")
    preprocess_data.main(["--input", str(good), "--output-prefix", out, *NULL])
    capsys.readouterr()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "4"}) + "\n{broken\n")
    before = tree_digest(str(tmp_path))
    err = _fail(capsys, ["--input", str(bad), "--output-prefix", out, "--strict", "--overwrite", *NULL])
    assert f"error: {bad}:2" in err
    assert tree_digest(str(tmp_path)) == before


def test_entry_point_exit_code_and_no_traceback(tmp_path):
    src = tmp_path / "empty.jsonl"
    src.write_text("")
    out = subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", str(src), "--output-prefix",
                          str(tmp_path / "c"), *NULL], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and f"error: {src}: no documents to write" in out.stderr
    assert "Traceback" not in out.stderr
    out = subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", str(src), "--output-prefix",
                          str(tmp_path / "c"), "--workers", "0", *NULL], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "error: --workers and --partitions must be >= 1" in out.stderr
