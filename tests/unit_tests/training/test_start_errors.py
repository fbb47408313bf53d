"""pretrain_gpt.py on bad input files: the dataset, the tokenizer, the model shape and the
device end with exit code 2 and one `error: ...` line naming the flag or file, at start-up
(or, for a bad sample, when it is read), never with a traceback. World of one, in process."""

from __future__ import annotations

import os

import numpy as np
import pytest

from megatron_lsgd.core.datasets.indexed_dataset import IndexedDatasetBuilder
from tests.unit_tests.checkpointing.launch import TINY
from tests.unit_tests.checkpointing.single import run_single
from tests.unit_tests.harness import tree_digest

# TINY without its mock data: these runs read files.
FILES = [a for a in TINY if a not in ("--mock-data", "--vocab-size", "250")]


def _run(argv, monkeypatch, capsys, base=TINY):
    code = run_single(argv, monkeypatch, base=base)
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return code, out.out, out.err


def _dataset(prefix: str, vocab: int) -> str:
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for _ in range(40):
        builder.add_document(rng.integers(0, vocab, size=60).astype(np.uint16))
    builder.finalize(prefix + ".idx")
    return prefix


def test_missing_tokenizer_model(monkeypatch, capsys, tmp_path):
    model = str(tmp_path / "absent.model")
    code, _, err = _run(["--train-iters", "2", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model],
                        monkeypatch, capsys)
    assert code == 2 and f"error: sentencepiece model not found: {model}" in err


def test_corrupt_tokenizer_model(monkeypatch, capsys, tmp_path):
    model = tmp_path / "broken.model"
    model.write_bytes(b"\x00\x01 not a model")
    code, _, err = _run(["--train-iters", "2", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                         str(model)],
                        monkeypatch, capsys)
    assert code == 2 and f"error: {model}: not a valid sentencepiece model" in err


def test_missing_dataset(monkeypatch, capsys, tmp_path):
    prefix = str(tmp_path / "absent_text_document")
    code, _, err = _run(["--train-iters", "2", "--data-path", prefix, "--tokenizer-type", "NullTokenizer",
                         "--vocab-size", "250"], monkeypatch, capsys, base=FILES)
    assert code == 2 and "error: indexed dataset file not found: " in err and prefix in err


def test_real_data_without_the_compiled_extension(monkeypatch, capsys, tmp_path):
    # a checkout used without `pip install -e .` (seen on a GPU machine): one line saying how to build it
    import sys

    import megatron_lsgd

    monkeypatch.delattr(megatron_lsgd, "_C", raising=False)
    monkeypatch.setitem(sys.modules, "megatron_lsgd._C", None)  # the import fails as if never built
    prefix = _dataset(str(tmp_path / "docs_text_document"), 250)
    code, _, err = _run(["--train-iters", "2", "--data-path", prefix, "--tokenizer-type", "NullTokenizer",
                         "--vocab-size", "250"], monkeypatch, capsys, base=FILES)
    assert code == 2 and "error: megatron_lsgd._C" in err and "pip install -e ." in err


def test_truncated_index(monkeypatch, capsys, tmp_path):
    prefix = _dataset(str(tmp_path / "c"), 250)
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(40)
    before = tree_digest(str(tmp_path))
    code, _, err = _run(["--train-iters", "2", "--data-path", prefix, "--tokenizer-type", "NullTokenizer",
                         "--vocab-size", "250"], monkeypatch, capsys, base=FILES)
    assert code == 2 and f"error: {prefix}.idx: truncated index" in err
    assert tree_digest(str(tmp_path)) == before


def test_tokens_outside_the_vocabulary_stop_when_read(monkeypatch, capsys, tmp_path):
    prefix = _dataset(str(tmp_path / "c"), 1000)  # made with a larger vocabulary than this run's
    code, out, err = _run(["--train-iters", "2", "--data-path", prefix, "--tokenizer-type", "NullTokenizer",
                           "--vocab-size", "250", "--split", "1,0,0"], monkeypatch, capsys, base=FILES)
    assert code == 2 and f"error: {prefix}.bin: token id" in err and "outside the tokenizer's vocabulary" in err


def test_heads_that_do_not_divide_the_hidden_size(monkeypatch, capsys):
    code, out, err = _run(["--train-iters", "2", "--hidden-size", "66"], monkeypatch, capsys)
    assert code == 2 and "error: --hidden-size 66 is not divisible by --num-attention-heads 4" in err
    assert "iteration" not in out


def test_nccl_without_cuda(monkeypatch, capsys):
    if __import__("torch").cuda.is_available():
        pytest.skip("CUDA is available here: nccl is a valid choice")
    code, _, err = _run(["--train-iters", "2", "--distributed-backend", "nccl"], monkeypatch, capsys)
    assert code == 2 and "error: --distributed-backend nccl needs CUDA" in err


def test_inter_site_nccl_without_cuda(monkeypatch, capsys):
    if __import__("torch").cuda.is_available():
        pytest.skip("CUDA is available here: nccl between sites is a valid choice")
    code, _, err = _run(["--train-iters", "2", "--inter-site-backend", "nccl"], monkeypatch, capsys)
    assert code == 2 and "error: --inter-site-backend nccl needs CUDA" in err


def test_device_cuda_without_cuda(monkeypatch, capsys):
    if __import__("torch").cuda.is_available():
        pytest.skip("CUDA is available here: --device cuda is a valid choice")
    code, _, err = _run(["--train-iters", "2", "--device", "cuda"], monkeypatch, capsys)
    assert code == 2 and "error: --device cuda needs CUDA" in err


def test_json_log_directory(monkeypatch, capsys, tmp_path):
    code, _, err = _run(["--train-iters", "2", "--json-log", str(tmp_path)], monkeypatch, capsys)
    assert code == 2 and f"error: --json-log {tmp_path} is a directory" in err
    assert os.listdir(tmp_path) == []


def test_evaluation_without_a_validation_split_warns_once(monkeypatch, capsys, tmp_path):
    from megatron_lsgd.training import guard

    monkeypatch.setattr(guard, "_warned", set())
    prefix = _dataset(str(tmp_path / "c"), 250)
    code, out, err = _run(["--train-iters", "4", "--data-path", prefix, "--tokenizer-type", "NullTokenizer",
                           "--vocab-size", "250", "--split", "100,0,0", "--eval-iters", "2", "--eval-interval", "2"],
                          monkeypatch, capsys, base=FILES)
    assert code == 0 and "validation loss" not in out
    assert err.count("warning: --split 100,0,0 gives the validation set no data, so evaluation (--eval-iters 2 "
                     "every --eval-interval 2 iterations) is skipped") == 1


@pytest.mark.parametrize("algorithm,warned", [("diloco", 1), ("edit", 1), ("sync", 0)])
def test_a_local_sgd_algorithm_with_one_site_warns_once(monkeypatch, capsys, algorithm, warned):
    from megatron_lsgd.training import guard

    monkeypatch.setattr(guard, "_warned", set())
    code, _out, err = _run(["--train-iters", "2", "--lsgd-algorithm", algorithm], monkeypatch, capsys)
    assert code == 0
    assert err.count(f"warning: --lsgd-algorithm {algorithm} with --num-sites 1 has nothing to synchronize") == warned


def test_data_that_do_not_match_are_refused(monkeypatch, capsys, tmp_path):
    """An .idx of another (smaller) dataset beside a .bin, --mock-data beside --data-path,
    a split without training data: refused at start-up, naming the files or flags."""
    big, small = _dataset(str(tmp_path / "big"), 250), str(tmp_path / "small")
    builder = IndexedDatasetBuilder(small + ".bin", np.uint16)
    builder.add_document(np.arange(60, dtype=np.uint16))
    builder.finalize(small + ".idx")
    os.replace(small + ".idx", big + ".idx")  # the run would read the first 120 bytes of the .bin only
    before = tree_digest(str(tmp_path))
    data = ["--data-path", big, "--tokenizer-type", "NullTokenizer", "--vocab-size", "250"]
    code, _, err = _run(["--train-iters", "2", *data], monkeypatch, capsys, base=FILES)
    assert code == 2 and f"error: {big}.idx describes 120 bytes of tokens but {big}.bin has 4800" in err
    assert tree_digest(str(tmp_path)) == before
    code, _, err = _run(["--train-iters", "2", "--data-path", big], monkeypatch, capsys)
    assert code == 2 and "error: --mock-data and --data-path exclude each other" in err
    code, _, err = _run(["--train-iters", "2", "--split", "0,0,100"], monkeypatch, capsys)
    assert code == 2 and "error: --split 0,0,100 gives the training set no data" in err


def test_launch_mistakes_say_what_happened(monkeypatch, capsys):
    """A port another process holds, and RANK/WORLD_SIZE left in the environment by an
    earlier session (the other ranks never come): one line each, exit 2, not a torch traceback."""
    import socket

    import pretrain_gpt
    from megatron_lsgd.training.initialize import free_port, init_distributed

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    for key, value in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", LOCAL_RANK="0").items():
        monkeypatch.setenv(key, value)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setenv("MASTER_PORT", str(port))
        with pytest.raises(SystemExit) as exc:
            pretrain_gpt.main(TINY + ["--train-iters", "2"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err
    assert f"error: MASTER_ADDR=127.0.0.1 MASTER_PORT={port}: the port is already in use" in err
    monkeypatch.setenv("WORLD_SIZE", "2")  # stale: no rank 1 will ever come
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(ValueError, match="only 1 of WORLD_SIZE=2 ranks joined .* the other ranks never started. "
                                         "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the environment"):
        init_distributed("gloo", 0.05)
    assert "note: joining a job of WORLD_SIZE=2 as RANK=0 from environment variables" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["build", "step"])
def test_out_of_memory_names_the_flags_to_lower(monkeypatch, capsys, where):
    """The allocator's report (simulated: there is no device to exhaust here) becomes one
    line naming this run's values of the flags that shrink memory."""
    import torch

    from megatron_lsgd.training import inner_step, training

    def exhausted(*_a, **_k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    if where == "build":
        monkeypatch.setattr(training, "ShardedOptimizer", exhausted)
    else:
        monkeypatch.setattr(inner_step.InnerStep, "compute_grads", exhausted)
    code, out, err = _run(["--train-iters", "2"], monkeypatch, capsys)
    assert code == 2 and err.count("error:") == 1
    assert "error: out of memory (CUDA out of memory. Tried to allocate 2.00 GiB). Lower --micro-batch-size " \
           "(now 2) or --seq-length (now 32), raise --tensor-model-parallel-size (now 1)" in err
