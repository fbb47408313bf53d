"""tools/benchmarks/quality/gpu_quality.py: the budget arithmetic, and the whole study at tiny size on
the CPU (the pipeline a lent GPU runs: pilot, sizing, four runs, the page's block)."""

from __future__ import annotations

import os

import pytest

from tools.benchmarks.quality import gpu_quality


def test_each_run_gets_an_equal_share_of_what_is_left():
    # 8 minutes, 100 s spent, 25 s start-up a run: (480 - 100 - 100) / 4 runs = 70 s of training
    # each; at 50,000 tokens/s and 32,768 tokens a step that is 106.8 -> 106 whole steps
    assert gpu_quality.study_iters(8, 50_000, 32_768, 100, 25, floor=60) == 106
    with pytest.raises(ValueError, match="leaves 53 steps a run .at least 60 needed.; give more minutes"):
        gpu_quality.study_iters(8, 25_000, 32_768, 100, 25, floor=60)


def test_no_gpu_is_refused_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr(gpu_quality.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        gpu_quality.main([])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "the study needs one; --tiny checks the pipeline" in err


@pytest.mark.slow
def test_the_tiny_study_writes_its_block_with_date_and_device(tmp_path, monkeypatch):
    corpus = os.path.join(gpu_quality.ROOT, "data", "python-docs")
    doc = tmp_path / "quality.md"
    doc.write_text("# Quality\n\nkept text\n")
    monkeypatch.setattr(gpu_quality, "ROOT", str(tmp_path))  # its cache goes under tmp_path/runs
    gpu_quality.main(["--tiny", "--minutes", "0.8", "--startup-seconds", "4", "--pilot-iters", "3",
                      "--data-path", os.path.join(corpus, "python_docs_text_document"),
                      "--valid-data-path", os.path.join(corpus, "python_docs_text_document"),
                      "--tokenizer-model", os.path.join(corpus, "python_docs_sp8k.model"), "--doc", str(doc)])
    text = doc.read_text()
    assert text.startswith("# Quality\n\nkept text\n") and "<!-- gpu-study:begin -->" in text
    assert "GPU study, " in text and ", CPU (TINY" in text and "tokens per parameter" in text
    for name in ("diloco-H30", "dilocox-H30", "streaming-diloco-H30"):
        assert f"| {name} " in text
    assert (tmp_path / "quality-gpu-study.json").exists()
