"""convert.py reshards the optimizer state: a converted checkpoint resumes training.

The exact comparison: a TP1 checkpoint converted to TP2 and back to TP1 resumes with the
very losses and weights of the TP1 run resumed from the original (the conversion moves
values and does no arithmetic). The TP2 -> TP1 step is the issue's case; resuming the TP2
intermediate itself (or a PP2 conversion) does different arithmetic, so it agrees to 1e-6.
Without the optimizer state the losses move by far more than that, so 1e-6 tells them
apart. The layouts cover ZeRO-1 with DP_intra 4 and 2, TP and PP changes, and DiLoCo's
anchors and outer momentum saved mid-round by ranks that split them (DP_intra 2 without
ZeRO-1), through TP2 and back, loaded with and without ZeRO-1.

All runs of a test share one spawned job; rank 0 converts between them.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.unit_tests.checkpointing.launch import TINY
from tests.unit_tests.harness import free_port, join_as_rank, merge_full_params, spawn

COMMON = TINY + ["--lr-decay-iters", "8", "--global-batch-size", "8", "--hidden-dropout", "0",
                 "--attention-dropout", "0"]
TP2 = ["--tensor-model-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
ZERO = ["--use-distributed-optimizer"]
RESUME = ["--train-iters", "8", "--no-load-rng"]


def _convert(src: str, dst: str, tp: int, pp: int) -> list:
    return ["--model-type", "GPT", "--loader", "lsgd", "--saver", "lsgd", "--load-dir", src, "--save-dir", dst,
            "--target-tensor-parallel-size", str(tp), "--target-pipeline-parallel-size", str(pp)]


def _job(rank: int, world: int, port: int, plan: list, out_dir: str) -> None:
    """Each step: ("train", name, argv) on every rank, or ("convert", argv) on rank 0."""
    join_as_rank(rank, world, port)
    import pretrain_gpt
    from tests.unit_tests.harness import _record
    from tools.checkpoint.convert import main as convert

    for step in plan:
        if step[0] == "train":
            _record(pretrain_gpt.main(step[2]), os.path.join(out_dir, f"{step[1]}.rank{rank}.pt"))
        elif rank == 0:
            assert convert(step[1]) == 0, step[1]
        dist.barrier()
    dist.destroy_process_group()


def _run_plan(tmp_path, plan: list, world: int) -> dict:
    out = tmp_path / "records"
    out.mkdir()
    spawn(_job, args=(world, free_port(), plan, str(out)), nprocs=world)
    names = [step[1] for step in plan if step[0] == "train"]
    return {name: [torch.load(out / f"{name}.rank{r}.pt", weights_only=False) for r in range(world)]
            for name in names}


def _losses(records) -> list:
    losses = records[-1]["losses"]  # the last rank logs, every iteration (--log-interval 1)
    assert len(losses) == 4, "iterations 5 to 8, after the checkpoint of iteration 4"
    return losses


def _worst(got: list, ref: list) -> float:
    return max(abs(a - b) for a, b in zip(got, ref))


def _assert_close(got: list, ref: list, what: str, atol: float = 1e-6) -> None:
    assert _worst(got, ref) <= atol, f"{what}: losses differ by {_worst(got, ref):.3g} ({got} vs {ref})"


@pytest.mark.slow
def test_tp1_to_tp2_to_tp1_resumes_like_the_tp1_checkpoint(tmp_path):
    ck = {k: str(tmp_path / k) for k in ("a", "tp2", "tp1", "pp2")}
    plan = [
        ("train", "saved", COMMON + ZERO + ["--train-iters", "4", "--save", ck["a"]]),  # TP1 x DP_intra 4, ZeRO-1
        ("train", "reference", COMMON + ZERO + ["--train-iters", "8", "--load", ck["a"]]),
        ("convert", _convert(ck["a"], ck["tp2"], 2, 1)),
        ("train", "tp2", COMMON + TP2 + ZERO + RESUME + ["--load", ck["tp2"]]),  # TP2 x DP_intra 2, ZeRO-1
        ("train", "tp2_fresh", COMMON + TP2 + ZERO + RESUME + ["--load", ck["tp2"], "--no-load-optim"]),
        ("convert", _convert(ck["tp2"], ck["tp1"], 1, 1)),
        ("train", "tp1", COMMON + ZERO + RESUME + ["--load", ck["tp1"]]),
        ("convert", _convert(ck["a"], ck["pp2"], 1, 2)),
        ("train", "pp2", COMMON + PP2 + RESUME + ["--load", ck["pp2"]]),  # PP2 x DP_intra 2, no ZeRO-1
    ]
    runs = _run_plan(tmp_path, plan, 4)
    ref = _losses(runs["reference"])

    assert _losses(runs["tp1"]) == ref, "TP2 -> TP1 resumes exactly like the TP1 checkpoint it came from"
    final, expected = merge_full_params(runs["tp1"]), merge_full_params(runs["reference"])
    for name, value in expected.items():
        assert torch.equal(final[name], value), name
    _assert_close(_losses(runs["tp2"]), ref, "resumed at TP2")
    _assert_close(_losses(runs["pp2"]), ref, "resumed at PP2")
    fresh = _losses(runs["tp2_fresh"])
    assert _worst(fresh, ref) > 1e-3, "without the optimizer state the losses move"


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", [["diloco", "--lsgd-interval", "3"],
                                       ["streaming-diloco", "--lsgd-interval", "4", "--lsgd-fragments", "2"]],
                         ids=["diloco", "streaming-diloco"])
def test_local_sgd_anchors_and_outer_momentum_are_resharded(tmp_path, algorithm):
    """The checkpoint of iteration 4 is inside a round (diloco, H = 3) or between fragment
    syncs (streaming), so the anchors and the outer momentum are not the model. Saved by
    DP_intra ranks without ZeRO-1, which each own a part of them; through TP2 and back,
    loaded at the same layout (exact) and under ZeRO-1 (1e-6). Each site reads its share of
    a global batch by DP_intra, so a local-SGD run is compared at equal DP_intra."""
    sites = ["--num-sites", "2", "--lsgd-outer-lr", "0.7", "--lsgd-outer-momentum", "0.9",  # a momentum to carry
             "--lsgd-algorithm"] + algorithm
    ck = {k: str(tmp_path / k) for k in ("a", "tp2", "tp1")}
    plan = [
        ("train", "saved", COMMON + sites + ["--train-iters", "4", "--save", ck["a"]]),  # 2 sites x DP_intra 2
        ("train", "reference", COMMON + sites + ["--train-iters", "8", "--load", ck["a"]]),
        ("convert", _convert(ck["a"], ck["tp2"], 2, 1)),
        ("convert", _convert(ck["tp2"], ck["tp1"], 1, 1)),
        ("train", "tp1", COMMON + sites + RESUME + ["--load", ck["tp1"]]),
        ("train", "tp1_zero", COMMON + sites + ZERO + RESUME + ["--load", ck["tp1"]]),
        ("train", "tp1_fresh", COMMON + sites + RESUME + ["--load", ck["tp1"], "--no-load-optim"]),
    ]
    runs = _run_plan(tmp_path, plan, 4)
    ref = _losses(runs["reference"])
    assert _losses(runs["tp1"]) == ref
    for site in range(2):
        final, expected = merge_full_params(runs["tp1"], site=site), merge_full_params(runs["reference"], site=site)
        for name, value in expected.items():
            assert torch.equal(final[name], value), (site, name)
    _assert_close(_losses(runs["tp1_zero"]), ref, "resumed under ZeRO-1")
    assert _worst(_losses(runs["tp1_fresh"]), ref) > 1e-3, "without the optimizer and synchronizer state the losses move"


# ---- one process: the dtype-specific state, and the refusals ------------------------------------------
def _run(argv, capsys) -> dict:
    from tests.unit_tests.checkpointing.launch import LOSS_LINE
    from tests.unit_tests.checkpointing.single import run_single

    with pytest.MonkeyPatch.context() as mp:
        code = run_single(COMMON[len(TINY):] + ["--global-batch-size", "2"] + argv, mp)
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    return {int(m.group(1)): float(m.group(2)) for m in LOSS_LINE.finditer(out.out)}


def _tool(capsys, *args):
    from tools.checkpoint.convert import main

    code = main(["--model-type", "GPT", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("flags", [["--bf16", "--optimizer", "muon"],
                                   ["--fp16", "--initial-loss-scale", "1048576", "--hysteresis", "1"]],
                         ids=["bf16-muon", "fp16-scaler"])
def test_dtype_and_optimizer_specific_state_is_converted(tmp_path, capsys, flags):
    """bf16 keeps an fp32 main copy beside the model, Muon a momentum of its own, fp16 a loss
    scale that came down from 2^20 after overflows (at 2^20 again, the resumed run would skip
    steps): all come back (in one process; the layouts are the slow tests' business)."""
    _run(flags + ["--train-iters", "3", "--save", str(tmp_path / "a")], capsys)
    ref = _run(flags + ["--train-iters", "6", "--load", str(tmp_path / "a")], capsys)
    code, _, err = _tool(capsys, *_convert(str(tmp_path / "a"), str(tmp_path / "b"), 1, 1))
    assert code == 0, err
    assert _run(flags + ["--train-iters", "6", "--load", str(tmp_path / "b"), "--no-load-rng"], capsys) == ref


def _rewrite_rank_file(ckpt: str, edit) -> None:
    """Change the (only) rank file of a one-rank checkpoint, keeping metadata.json's record true."""
    import json

    from megatron_lsgd.training.checkpointing.safe_io import save_file

    iter_dir = os.path.join(ckpt, "iter_" + open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read()
                            .strip().zfill(7))
    rel = os.path.join("mp_rank_00", "rank_site_000_dp_000.pt")
    state = torch.load(os.path.join(iter_dir, rel), weights_only=True)
    edit(state)
    meta_path = os.path.join(iter_dir, "metadata.json")
    meta = json.load(open(meta_path))
    meta["files"][rel], meta["sha256"][rel] = save_file(state, os.path.join(iter_dir, rel), rel)
    json.dump(meta, open(meta_path, "w"))


def test_what_cannot_be_converted_is_one_error_line(ckpt, tmp_path, capsys):
    out = str(tmp_path / "out")
    weights = str(tmp_path / "weights")
    assert _tool(capsys, *_convert(ckpt, weights, 1, 1), "--model-only")[0] == 0
    code, _, err = _tool(capsys, *_convert(weights, out, 1, 1))
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1
    assert f"--load-dir {weights} holds no optimizer state" in err and "--model-only" in err

    code, _, err = _tool(capsys, "--loader", "lsgd", "--saver", "hf", "--load-dir", ckpt, "--save-dir", out,
                         "--model-only")
    assert code == 2 and "error: --model-only applies to --loader lsgd --saver lsgd only" in err

    def error_feedback(state):  # what a compressed sync keeps per rank
        state["synchronizer"] = {"compressors": {"all": {"errors": [torch.ones(3)]}}}

    _rewrite_rank_file(ckpt, error_feedback)
    code, _, err = _tool(capsys, *_convert(ckpt, out, 1, 1))
    assert code == 2 and err.count("\n") == 1
    assert "error: cannot reshard the --lsgd-algorithm sync state of" in err
    assert "compressors/all/errors/0 holds rank-specific tensors" in err and "--model-only" in err

    def written_before_layouts(state):
        state["synchronizer"] = {}
        del state["optimizer"]["layout"]

    _rewrite_rank_file(ckpt, written_before_layouts)
    code, _, err = _tool(capsys, *_convert(ckpt, out, 1, 1))
    assert code == 2 and "saved before checkpoints recorded which parameter each optimizer value belongs to" in err
    assert not os.path.exists(out)


def test_a_converted_checkpoint_loads_without_rng_and_with_its_sites(ckpt, tmp_path, capsys):
    import json

    from tests.unit_tests.checkpointing.single import run_single

    def load(*flags):
        with pytest.MonkeyPatch.context() as mp:
            code = run_single(["--train-iters", "3", "--load", out, *flags], mp)
        return code, capsys.readouterr().err

    out = str(tmp_path / "out")
    assert _tool(capsys, *_convert(ckpt, out, 1, 1))[0] == 0
    code, err = load()
    assert code == 2 and "holds no RNG state (convert.py does not convert RNG states" in err
    assert "--no-load-rng" in err

    meta_path = os.path.join(out, "iter_0000002", "metadata.json")
    meta = json.load(open(meta_path))
    meta["layout"]["sites"] = 2  # as if converted from a two-site run
    json.dump(meta, open(meta_path, "w"))
    code, err = load("--no-load-rng")
    assert code == 2 and "holds the optimizer state of 2 sites, this run has --num-sites 1" in err
    assert load("--no-load-rng", "--no-load-optim")[0] == 0


def test_a_pipeline_change_is_refused_for_state_organised_by_stage():
    """streaming-diloco's fragments (and dreamddp's plan) are made of a stage's units: their
    keys and schedules mean something else at another PP size (a 2-site run through TP2 ->
    PP2 resumed 5.7e-3 away from the source before this was refused)."""
    from megatron_lsgd.training.checkpointing.errors import CheckpointError
    from megatron_lsgd.training.checkpointing.resume_state import (ResumeState, SiteState,
                                                                   check_target_layout)

    def state(algorithm, sites=2, pp=(1, 1)):
        return ResumeState([SiteState({}, {}, {}) for _ in range(sites)], {"lsgd_algorithm": algorithm},
                           source_pp=list(pp[:sites]))

    for algorithm in ("streaming-diloco", "cocodc", "dreamddp"):
        with pytest.raises(CheckpointError, match=f"cannot reshard the --lsgd-algorithm {algorithm} state from "
                                                  f"pipeline-parallel size 1 to 2: it is organised by pipeline stage"):
            check_target_layout(state(algorithm), 2)
        check_target_layout(state(algorithm), 1)  # TP and DP_intra may change
        check_target_layout(state(algorithm, sites=1), 2)  # one site: the synchronizer does nothing
        # sites of different PP sizes: any target moves one site's stages
        for pp in (1, 2):
            with pytest.raises(CheckpointError, match=f"from pipeline-parallel size 2,1 to {pp}: .* The sites' "
                                                      f"pipeline sizes differ, so convert with --model-only"):
                check_target_layout(state(algorithm, pp=(2, 1)), pp)
    for algorithm in ("sync", "diloco", "edit"):
        check_target_layout(state(algorithm), 2)


def test_sites_of_different_sizes_convert_only_at_one_data_position():
    """A checkpoint of sites 2 + 1 drops each site's sample count (its 2:1 share would not fit
    another layout: each site resumes at its share of the job's count), which is right only
    when the sites stand at one position of the global order."""
    from types import SimpleNamespace

    from megatron_lsgd.training.checkpointing.errors import CheckpointError
    from megatron_lsgd.training.checkpointing.resume_state import _check_in_step

    def src(counts):
        return SimpleNamespace(iter_dir="ck/iter_0000003", meta={"consumed_samples": 36,
                                                                  "site_consumed_samples": counts})
    _check_in_step(src([24, 12]), [2, 1])
    for counts in ([18, 18], [24, 16]):
        with pytest.raises(CheckpointError, match=r"ck/iter_0000003: the sites' consumed samples .* are not their "
                                                  r"shares of the job's 36 for data-parallel sizes 2,1"):
            _check_in_step(src(counts), [2, 1])
