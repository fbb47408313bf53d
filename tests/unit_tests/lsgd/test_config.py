"""Incompatible lsgd flags fail at start with a message naming the flag; each algorithm's
options form their own --help group; every existing flag keeps its meaning."""

import json
import subprocess
import sys

import pytest

from megatron_lsgd.core.lsgd.protocol import Synchronizer
from megatron_lsgd.core.lsgd.registry import register, registered_algorithms
from megatron_lsgd.training.arguments import build_config, build_parser, parse_args

if "no-compression-test" not in registered_algorithms():
    @register
    class _Uncompressed(Synchronizer):
        """A test algorithm that sends nothing compressible"""

        name = "no-compression-test"

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "1", "--train-iters", "10", "--lr", "1e-3", "--mock-data", "--vocab-size", "100"]


def config(extra, world=2):
    return build_config(parse_args(BASE + extra), world)


@pytest.mark.parametrize("extra,flag", [
    (["--num-sites", "2", "--lsgd-algorithm", "diloco", "--lsgd-interval", "0"], "--lsgd-interval"),
    (["--num-sites", "2", "--lsgd-algorithm", "diloco", "--lsgd-outer-lr", "0"], "--lsgd-outer-lr"),
    (["--num-sites", "2", "--lsgd-algorithm", "diloco", "--lsgd-outer-momentum", "1.0"], "--lsgd-outer-momentum"),
    (["--num-sites", "2", "--lsgd-algorithm", "no-compression-test", "--lsgd-compression", "int4"],
     "--lsgd-compression int4 is not supported by --lsgd-algorithm no-compression-test"),
    (["--num-sites", "2", "--lsgd-algorithm", "dilocox", "--lsgd-compression", "lowrank-int4"], "--lsgd-rank"),
    (["--num-sites", "2", "--lsgd-algorithm", "dilocox", "--lsgd-compression", "int4", "--lsgd-rank", "4"],
     "--lsgd-rank"),
    (["--num-sites", "2", "--lsgd-algorithm", "diloco", "--lsgd-adaptive"], "--lsgd-adaptive"),
    (["--num-sites", "2", "--lsgd-algorithm", "dilocox", "--lsgd-quant-block", "3"], "--lsgd-quant-block"),
    (["--num-sites", "2", "--lsgd-algorithm", "diloco", "--lsgd-compression", "int4", "--lsgd-topk-density", "0.1"],
     "--lsgd-topk-density only applies to --lsgd-compression topk-2bit"),
    (["--num-sites", "2", "--lsgd-algorithm", "diloco", "--lsgd-compression", "topk-2bit", "--lsgd-topk-density", "0"],
     "--lsgd-topk-density"),
    (["--num-sites", "2", "--lsgd-algorithm", "diloco", "--lsgd-compression", "topk-2bit", "--lsgd-topk-chunk",
      "70000"], "--lsgd-topk-chunk"),
    (["--num-sites", "2", "--lsgd-algorithm", "diloco", "--lsgd-compression", "topk-2bit", "--lsgd-quantized-mean",
      "alltoall"], "--lsgd-quantized-mean does not apply"),
    (["--num-sites", "2", "--lsgd-algorithm", "diloco", "--lsgd-ef-decay", "0.9"], "--lsgd-ef-decay needs"),
    (["--num-sites", "2", "--lsgd-algorithm", "cocodc", "--lsgd-cocodc-dc-beta", "0.9"],
     "--lsgd-cocodc-dc-beta needs --lsgd-cocodc-dc-normalize mean-square"),
    (["--num-sites", "2", "--lsgd-algorithm", "cocodc", "--lsgd-cocodc-dc-normalize", "mean-square",
      "--lsgd-cocodc-dc-beta", "1"], "--lsgd-cocodc-dc-beta must be in"),
    (["--num-sites", "2", "--lsgd-algorithm", "diloco", "--lsgd-compression", "int8", "--lsgd-ef-decay", "1.5"],
     "--lsgd-ef-decay"),
    (["--num-sites", "2", "--lsgd-algorithm", "dilocox", "--lsgd-adaptive", "--lsgd-adaptive-h-min", "10",
      "--lsgd-adaptive-h-max", "5"], "--lsgd-adaptive-h-min"),
    (["--num-sites", "2", "--simulate-inter-site-bandwidth", "-1"], "--simulate-inter-site-bandwidth"),
    (["--num-sites", "1", "--lsgd-algorithm", "dilocox"], "--num-sites"),
    (["--num-sites", "2", "--lsgd-algorithm", "dilocox", "--lsgd-interval", "10", "--lsgd-dilocox-apply-step", "11"],
     "--lsgd-dilocox-apply-step"),
    (["--num-sites", "2", "--lsgd-algorithm", "dilocox", "--lsgd-dilocox-apply-step", "-1"],
     "--lsgd-dilocox-apply-step"),
    (["--num-sites", "2", "--lsgd-algorithm", "diloco", "--lsgd-dilocox-apply-step", "2"],
     "--lsgd-dilocox-apply-step needs --lsgd-algorithm dilocox"),
    (["--num-sites", "2", "--lsgd-algorithm", "sync", "--lsgd-adaptive-window", "3"],
     "--lsgd-adaptive-window needs --lsgd-algorithm dilocox"),
])
def test_bad_flags_name_the_flag(extra, flag):
    with pytest.raises(ValueError, match=flag):
        config(extra)


def test_good_flags_build():
    cfg = config(["--num-sites", "2", "--lsgd-algorithm", "dilocox", "--lsgd-compression", "lowrank-int4",
                  "--lsgd-rank", "8", "--lsgd-adaptive", "--lsgd-interval", "25", "--optimizer", "sgd",
                  "--simulate-inter-site-latency", "5", "--lsgd-outer-offload"])
    lsgd = cfg.lsgd
    assert lsgd.compression.kind == "lowrank-int4" and lsgd.compression.rank == 8 and lsgd.rounds.interval == 25
    assert lsgd.algo.adaptive and lsgd.algo.adaptive_h_min == 25 and lsgd.algo.adaptive_h_max == 100
    assert lsgd.link.latency_ms == 5 and lsgd.outer.offload and cfg.optimizer.optimizer == "sgd"


@pytest.mark.parametrize("algorithm", ["sync", "diloco", "dilocox"])
def test_any_of_the_built_in_algorithms_takes_a_compressor(algorithm):
    cfg = config(["--num-sites", "2", "--lsgd-algorithm", algorithm, "--lsgd-compression", "int8"])
    assert cfg.lsgd.compression.kind == "int8"


def test_help_shows_one_group_per_algorithm():
    groups = {g.title: [a.option_strings[0] for a in g._group_actions] for g in build_parser()._action_groups}
    assert "dilocox (--lsgd-algorithm dilocox)" in groups
    assert "--lsgd-dilocox-apply-step" in groups["dilocox (--lsgd-algorithm dilocox)"]
    shared = [t for t in groups if t.startswith("outer optimizer")]
    assert shared and groups[shared[0]] == ["--lsgd-outer-lr", "--lsgd-outer-momentum", "--lsgd-outer-offload",
                                            "--lsgd-outer-momentum-warmup", "--lsgd-outer-decay-start",
                                            "--lsgd-outer-decay-steps", "--lsgd-outer-decay-style",
                                            "--lsgd-outer-min-lr", "--lsgd-outer-momentum-final"]
    text = subprocess.run([sys.executable, "pretrain_gpt.py", "--help"], capture_output=True, text=True, timeout=120,
                          cwd=__file__.rsplit("/tests/", 1)[0]).stdout
    for name in ("sync", "diloco", "dilocox"):
        assert f"--lsgd-algorithm {name}" in text
    assert "Shared option groups it uses: compression, outer, rounds." in text  # diloco's group describes itself


@pytest.mark.parametrize("extra,message", [
    (["--train-iters", "5", "--train-samples", "40"], "give exactly one of --train-iters, --train-samples"),
    (["--train-samples", "1"], "--train-samples 1 is less than one global batch"),
    (["--train-tokens", "40"], "--train-tokens 40 is less than one global batch"),
    (["--train-iters", "5", "--exit-duration-in-mins", "0"], "--exit-duration-in-mins must be > 0"),
])
def test_training_length_flags(extra, message):
    base = [a for a in BASE if a not in ("--train-iters", "10")]
    with pytest.raises(ValueError, match=message):
        build_config(parse_args(base + extra), 2)


def test_budgets_become_iterations_like_megatron():
    base = [a for a in BASE if a not in ("--train-iters", "10")] + ["--global-batch-size", "4"]
    by_samples = build_config(parse_args(base + ["--train-samples", "42"]), 2)
    assert by_samples.training.train_iters == 10 and by_samples.training.train_samples == 42  # 42 // 4
    by_tokens = build_config(parse_args(base + ["--train-tokens", str(41 * 32 + 5)]), 2)
    assert by_tokens.training.train_iters == 10 and by_tokens.training.train_samples == 41
    # Megatron's sample-based schedule: the LR decays over the budget's samples, stepping by each batch.
    assert by_tokens.optimizer.lr_unit == "samples" and by_tokens.optimizer.lr_decay_iters == 41


@pytest.mark.slow
def test_a_rank_larger_than_a_weight_matrix_is_a_message_on_two_sites(tmp_path):
    """Found at start-up (it needs the model's shapes), agreed by every rank: error + exit 2."""
    import os

    from tests.unit_tests.checkpointing.launch import ROOT
    from tests.unit_tests.harness import free_port

    port, procs = free_port(), []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        procs.append(subprocess.Popen([sys.executable, "pretrain_gpt.py"] + BASE + [
            "--num-sites", "2", "--lsgd-algorithm", "dilocox", "--lsgd-compression", "lowrank-int4",
            "--lsgd-rank", "1000"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [2, 2]
    err = "".join(e for _, e in outs)
    assert err.count("error: --lsgd-rank 1000 is larger than the smallest weight matrix dimension (32)") == 1
    assert "Traceback" not in err


@pytest.mark.parametrize("extra,message", [
    # a shared flag the chosen algorithm never reads
    (["--lsgd-algorithm", "sync", "--lsgd-interval", "5"],
     "--lsgd-interval has no effect with --lsgd-algorithm sync; it applies to "),
    (["--lsgd-algorithm", "acco", "--lsgd-outer-lr", "0.5"],
     "--lsgd-outer-lr has no effect with --lsgd-algorithm acco"),
    (["--lsgd-algorithm", "dreamddp", "--lsgd-outer-momentum", "0.5"], "--lsgd-outer-momentum has no effect"),
    (["--lsgd-algorithm", "diloco", "--lsgd-quant-block", "32"],
     "--lsgd-quant-block has no effect without --lsgd-compression \\(int8, int4, lowrank-int4, topk-2bit\\)"),
    # a warm-up longer than the run
    (["--lsgd-algorithm", "diloco", "--lsgd-warmup-iters", "10"],
     "--lsgd-warmup-iters 10 covers the whole run \\(10 iterations\\): --lsgd-algorithm diloco would never run"),
    (["--lr-warmup-iters", "11"], "--lr-warmup-iters 11 is longer than the run \\(10 iterations\\)"),
])
def test_settings_that_would_be_ignored_are_refused(extra, message):
    with pytest.raises(ValueError, match=message):
        config(["--num-sites", "2"] + extra)


@pytest.mark.parametrize("flag", ["--simulate-inter-site-latency", "--lsgd-aedit-interval-seconds", "--lr",
                                  "--slow-factor"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_values_are_refused_naming_the_flag(flag, value, capsys):
    extra = ["--lsgd-algorithm", "a-edit"] if flag == "--lsgd-aedit-interval-seconds" else []
    with pytest.raises(SystemExit) as exc:
        parse_args(BASE + extra + [f"{flag}={value}"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"error: argument {flag}: must be a finite number, got '{value}'" in err


def test_settings_bounded_by_the_model_are_checked_against_it(tmp_path):
    """The run's facts (RunFacts: layers, stages) reach every algorithm's validation."""
    with pytest.raises(ValueError, match="--lsgd-fragments 3 is more than the model's 2 layers"):
        config(["--num-sites", "2", "--lsgd-algorithm", "cocodc", "--lsgd-interval", "6", "--lsgd-fragments", "3"])
    from megatron_lsgd.core.lsgd.algorithms.dreamddp.profile import PROFILE_FORMAT

    profile = tmp_path / "profile.json"
    units = ["embedding", "layers.0", "layers.1", "layers.2", "output"]  # a 3-layer model's
    profile.write_text(json.dumps({"format": PROFILE_FORMAT, "units": [{"name": n, "backward_ms": 1.0} for n in units],
                                   "stages": [{"tail_ms": 0.5}], "link": {"latency_ms": 1.0, "ms_per_MB": 2.0}}))
    dreamddp = ["--num-sites", "2", "--lsgd-algorithm", "dreamddp", "--lsgd-dreamddp-profile", str(profile)]
    config(dreamddp)  # 2 layers: every unit the model has is in the profile
    with pytest.raises(ValueError, match="has no backward time for layers.3"):
        four_layers = BASE[:1] + ["4"] + BASE[2:]  # BASE starts with --num-layers 2
        build_config(parse_args(four_layers + dreamddp), 2)
    with pytest.raises(ValueError, match="written for 1 pipeline stages"):
        config(dreamddp + ["--pipeline-model-parallel-size", "2"], world=4)
