"""tools/preprocess_data.py, merge_datasets.py, train_tokenizer.py on small inputs."""

from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pytest

import merge_datasets
import preprocess_data
import train_tokenizer
from megatron_lsgd.core.datasets import IndexedDataset

from datatest_utils import SP_MODEL

NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]


def _write_jsonl(path, lines, gz=False):
    opener = gzip.open if gz else open
    with opener(path, "wt", encoding="utf-8") as f:
        for line in lines:
            f.write(line + "\n")
    return str(path)


def _docs(prefix):
    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


def test_preprocess_null_tokenizer_and_bad_lines(tmp_path, capsys):
    src = _write_jsonl(tmp_path / "in.jsonl", [
        json.dumps({"text": "1 2 3"}),
        "{not json",
        json.dumps({"other": "4"}),
        json.dumps({"text": ""}),
        "",
        json.dumps({"text": 5}),
        json.dumps({"text": "7 8"}),
        "[1, 2]",
    ])
    out = str(tmp_path / "out" / "corpus")
    stats = preprocess_data.main(["--input", src, "--output-prefix", out, "--append-eod", *NULL])
    assert (stats.documents, stats.bad_lines, stats.empty) == (3, 4, 1)
    assert _docs(out + "_text_document") == [[1, 2, 3, 999], [7, 8, 999]]
    assert IndexedDataset(out + "_text_document").dtype == np.uint16
    err = capsys.readouterr().err
    assert f"{src}:2: not valid JSON" in err
    assert f"{src}:3: missing key 'text'" in err
    assert f"{src}:6: key 'text' is int, not a string" in err
    assert f"{src}:8: expected a JSON object, got list" in err
    assert "1 empty documents skipped, 4 bad lines skipped" in err and "MB/s" in err


def _fails(capsys, main, argv) -> str:
    """A tool's bad-input exit: code 2 and the message on stderr."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_preprocess_strict_names_file_and_line(tmp_path, capsys):
    src = _write_jsonl(tmp_path / "in.jsonl", [json.dumps({"text": "1"}), "[1, 2"])
    err = _fails(capsys, preprocess_data.main, ["--input", src, "--output-prefix", str(tmp_path / "o"), "--strict",
                                                *NULL])
    assert "in.jsonl:2: not valid JSON" in err
    assert not list(tmp_path.glob("o_*"))  # the partial .bin was removed


@pytest.mark.parametrize("workers", ["1", "2"])
def test_preprocess_untokenizable_line(tmp_path, capsys, workers):
    src = _write_jsonl(tmp_path / "in.jsonl", [json.dumps({"text": "1 2"}), json.dumps({"text": "one two"})])
    stats = preprocess_data.main(["--input", src, "--output-prefix", str(tmp_path / "o"), "--workers", workers,
                                  *NULL])
    assert (stats.documents, stats.bad_lines) == (1, 1)
    assert f"{src}:2: cannot tokenize: NullTokenizer: 'one' is not an integer" in capsys.readouterr().err


def test_preprocess_missing_input(tmp_path, capsys):
    err = _fails(capsys, preprocess_data.main, ["--input", str(tmp_path / "absent.jsonl"), "--output-prefix",
                                                str(tmp_path / "o"), *NULL])
    assert "error: input file not found: " in err and "absent.jsonl" in err


def test_preprocess_workers_partitions_keys_gz(tmp_path):
    rng = np.random.default_rng(0)
    lines = [json.dumps({"text": " ".join(map(str, rng.integers(0, 900, size=int(rng.integers(1, 30))))),
                         "title": str(i)}) for i in range(200)]
    src = _write_jsonl(tmp_path / "in.jsonl.gz", lines, gz=True)
    common = ["--input", src, "--json-keys", "text", "title", "--append-eod", "--log-interval", "50", *NULL]
    preprocess_data.main([*common, "--output-prefix", str(tmp_path / "one")])
    preprocess_data.main([*common, "--output-prefix", str(tmp_path / "par"), "--workers", "2", "--partitions", "2"])
    for key in ("text", "title"):
        for ext in (".bin", ".idx"):
            one = open(str(tmp_path / f"one_{key}_document{ext}"), "rb").read()
            assert one == open(str(tmp_path / f"par_{key}_document{ext}"), "rb").read()
    assert _docs(str(tmp_path / "one_title_document"))[7] == [7, 999]
    assert not [f for f in os.listdir(tmp_path) if "_part" in f]


def test_preprocess_sentencepiece_dtype_and_text(tmp_path):
    src = _write_jsonl(tmp_path / "in.jsonl", [json.dumps({"text": "Hello, world.\n  indented"})])
    out = str(tmp_path / "sp")
    preprocess_data.main(["--input", src, "--output-prefix", out, "--tokenizer-type", "SentencePieceTokenizer",
                          "--tokenizer-model", SP_MODEL, "--append-eod"])
    from megatron_lsgd.training.tokenizer import TokenizerConfig, build_tokenizer

    tok = build_tokenizer(TokenizerConfig("SentencePieceTokenizer", tokenizer_model=SP_MODEL))
    (doc,) = _docs(out + "_text_document")
    assert doc[-1] == tok.eod and tok.detokenize(doc[:-1]) == "Hello, world.\n  indented"


def test_merge_tool(tmp_path, capsys):
    for name, text in (("a", "1 2"), ("b", "3")):
        src = _write_jsonl(tmp_path / f"{name}.jsonl", [json.dumps({"text": text})])
        preprocess_data.main(["--input", src, "--output-prefix", str(tmp_path / "parts" / name), *NULL])
    merge_datasets.main(["--input", str(tmp_path / "parts"), "--output-prefix", str(tmp_path / "merged")])
    assert _docs(str(tmp_path / "merged")) == [[1, 2], [3]]
    err = _fails(capsys, merge_datasets.main, ["--input", str(tmp_path / "missing"), "--output-prefix",
                                               str(tmp_path / "m")])
    assert "indexed dataset file not found: " in err and "missing.idx" in err
    (tmp_path / "empty").mkdir()
    err = _fails(capsys, merge_datasets.main, ["--input", str(tmp_path / "empty"), "--output-prefix",
                                               str(tmp_path / "m")])
    assert "no .bin/.idx pairs" in err


def test_train_tokenizer_small(tmp_path):
    src = _write_jsonl(tmp_path / "in.jsonl", [json.dumps({"text": f"line {i} of text\n    code({i})"})
                                               for i in range(300)] + ["{bad"])
    prefix = str(tmp_path / "sp")
    train_tokenizer.main(["--input", src, "--model-prefix", prefix, "--vocab-size", "300"])
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
    assert sp.vocab_size() == 300
    text = "line 7 of text\n    code(7)"
    assert sp.decode(sp.encode(text)) == text


def test_tool_mistakes_end_in_one_error_line(tmp_path, capsys):
    """Each tool's bad input: exit code 2, one `error:` line naming the flag, no traceback,
    no usage block, nothing written (and an existing output is not replaced silently)."""
    import slice_jsonl

    src = _write_jsonl(tmp_path / "in.jsonl", [json.dumps({"text": t}) for t in ("hello world", "abc def", "1 2 3")])
    before = sorted(os.listdir(tmp_path))

    def fails(main, argv, message):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "Traceback" not in err and "usage:" not in err
        assert err.count("error:") == 1 and f"error: {message}" in err, err
        assert sorted(os.listdir(tmp_path)) == before

    fails(train_tokenizer.main, ["--input", src, "--model-prefix", str(tmp_path / "tok"), "--vocab-size", "5000"],
          "--vocab-size: sentencepiece cannot train this model on this corpus: Vocabulary size too high (5000)")
    fails(slice_jsonl.main, ["--input", src, "--output", str(tmp_path / "s.jsonl"), "--every", "0"],
          "--every must be >= 1 (got 0)")
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--input", src]
    fails(preprocess_data.main, [*null, "--output-prefix", str(tmp_path / "c"), "--chunk-size", "0"],
          "--chunk-size must be >= 1 (got 0)")
    fails(preprocess_data.main, [*null, "--output-prefix", str(tmp_path / "c"), "--no-such-flag"],
          "unrecognized arguments: --no-such-flag (see ")
    preprocess_data.main([*null, "--output-prefix", str(tmp_path / "c")])
    capsys.readouterr()
    before = sorted(os.listdir(tmp_path))
    digest = open(tmp_path / "c_text_document.bin", "rb").read()
    fails(preprocess_data.main, [*null, "--output-prefix", str(tmp_path / "c")],
          f"--output-prefix {tmp_path / 'c'}: {tmp_path / 'c'}_text_document.bin already exists; choose another "
          f"prefix, or pass --overwrite")
    assert open(tmp_path / "c_text_document.bin", "rb").read() == digest
    preprocess_data.main([*null, "--output-prefix", str(tmp_path / "c"), "--overwrite"])
