"""--full-validation (Megatron's meaning): every evaluation covers the whole validation split,
the same samples each time, so the points of a validation curve compare. In-process runs
(a world of one) on the bundled corpus."""

from __future__ import annotations

import os
import re

import pytest

from tests.unit_tests.checkpointing.launch import ROOT
from tests.unit_tests.checkpointing.single import run_single

DATA = os.path.join(ROOT, "data", "python-docs")
CORPUS = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
          "--micro-batch-size", "4", "--lr-decay-style", "constant", "--log-interval", "4", "--seed", "3",
          "--hidden-dropout", "0", "--attention-dropout", "0", "--tokenizer-type", "SentencePieceTokenizer",
          "--tokenizer-model", os.path.join(DATA, "python_docs_sp8k.model"),
          "--data-path", os.path.join(DATA, "python_docs_text_document")]
# An Adam step of 1e-12 is below the resolution of every fp32 weight of this size: the model
# does not change, so two evaluations differ only if their samples do.
# Three micro-batches a step: the split's 257 samples make 21 whole global batches, and an
# evaluation that did not start again from the first sample would begin the next one elsewhere.
FROZEN = ["--train-iters", "4", "--lr", "1e-12", "--eval-interval", "2", "--eval-iters", "1",
          "--global-batch-size", "12"]


def _run(argv, monkeypatch, capsys):
    code = run_single(argv, monkeypatch, base=CORPUS)
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return code, out.out, out.err


def _validation_losses(text: str):
    return re.findall(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)", text)


def test_every_evaluation_covers_the_same_whole_split(monkeypatch, capsys):
    code, out, err = _run(FROZEN + ["--split", "989,10,1"], monkeypatch, capsys)
    assert code == 0, err
    sampled = [loss for _, loss in _validation_losses(out)]
    assert len(sampled) == 2 and sampled[0] != sampled[1]  # Megatron's default: the next batches each time
    # the start says how much of the train split the budget (4 steps x 12 samples of 32) reads
    tokens, percent = re.search(r"> training data: ([\d,]+) tokens in the train split; the budget \(48 samples "
                                r"of 32\) reads ([\d.]+)% of it\n", out).groups()
    tokens = int(tokens.replace(",", ""))
    assert 1e6 < tokens < 1.373154e6 and float(percent) == float(f"{100 * 48 * 32 / tokens:.2g}")

    code, out, err = _run(FROZEN + ["--split", "989,10,1", "--full-validation"], monkeypatch, capsys)
    assert code == 0, err
    batches = int(re.search(r"> full validation: (\d+) global batches \((\d+) samples\)", out).group(1))
    assert batches > 1  # --eval-iters 1 only switched evaluation on
    full = [loss for _, loss in _validation_losses(out)]
    assert len(full) == 2 and full[0] == full[1]


def test_full_validation_refuses_what_has_no_split(monkeypatch, capsys):
    code, _, err = _run(["--train-iters", "2", "--lr", "1e-3", "--split", "999999,1,0", "--full-validation",
                         "--eval-iters", "1", "--global-batch-size", "4096"], monkeypatch, capsys)
    assert code == 2, err
    assert err.count("error:") == 1 and "--full-validation" in err and "fewer than one global batch" in err

    code = run_single(["--train-iters", "2", "--full-validation"], monkeypatch)  # the tests' mock-data run
    err = capsys.readouterr().err
    assert code == 2 and "error: --full-validation needs a validation split" in err and "--mock-data" in err


def test_validation_times_are_training_time(monkeypatch):
    """On the simulated clock, evaluating more batches lengthens the run but moves no
    validation time: the time spent evaluating is summed apart (TrainingResult)."""
    import pretrain_gpt
    import torch.distributed as dist

    from tests.unit_tests.harness import free_port

    def run(eval_iters):
        for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                         MASTER_PORT=str(free_port())).items():
            monkeypatch.setenv(k, v)
        try:
            return pretrain_gpt.main(CORPUS + ["--distributed-backend", "gloo", "--train-iters", "4", "--lr", "1e-3",
                                               "--eval-interval", "2", "--eval-iters", str(eval_iters), "--split",
                                               "989,10,1", "--simulate-clock"])
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    one, four = run(1), run(4)
    assert one.validation_iterations == four.validation_iterations == [2, 4]
    assert one.validation_seconds == four.validation_seconds and one.validation_seconds[0] > 0
    assert four.evaluation_seconds > one.evaluation_seconds > 0
    assert four.clock_seconds - four.evaluation_seconds == pytest.approx(one.clock_seconds - one.evaluation_seconds)
