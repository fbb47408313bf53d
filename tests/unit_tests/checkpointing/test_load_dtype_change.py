"""A bf16 checkpoint loaded by an fp32 run takes the saved fp32 main copy as its weights on
every rank. Under ZeRO-1 an fp32 run's main shards are views of its parameter buffer, so
the loaded main copy lands only in this rank's shard: unless the shards are gathered, the
site's ranks start from different weights (their own shard at fp32, the rest rounded to
bf16). Each layout (DP_intra 4, 2 and 1; TP2 and PP2) loads the checkpoint it saved, as
saved (one file per rank) and converted (by parameter), and every rank's parameters must
equal the single-rank state: the fp32 main copy of the checkpoint converted to TP1 x PP1.

All runs share one spawned job of 4 ranks; rank 0 converts between them.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_lsgd.training.checkpointing import layout
from tests.unit_tests.checkpointing.test_convert_optimizer import COMMON, ZERO, _convert, _run_plan
from tests.unit_tests.harness import merge_full_params

LAYOUTS = {"dp4": (1, 1), "tp2-dp2": (2, 1), "pp2-dp2": (1, 2), "tp2-pp2-dp1": (2, 2)}


def _parallel(tp: int, pp: int) -> list:
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]


def _single_rank_main(ckpt: str) -> dict:
    """The fp32 main copy by parameter of a TP1 x PP1 converted checkpoint."""
    iteration = open(os.path.join(ckpt, layout.TRACKER)).read().strip()
    iter_dir = os.path.join(ckpt, "iter_" + iteration.zfill(7))
    record = torch.load(os.path.join(iter_dir, "mp_rank_00", layout.optimizer_file_name(0)), weights_only=False)
    return record["tensors"]["main"]


@pytest.mark.slow
def test_fp32_run_loads_a_bf16_checkpoints_main_copy_on_every_rank(tmp_path):
    plan, ck = [], {}
    for name, (tp, pp) in LAYOUTS.items():
        ck[name] = {k: str(tmp_path / f"{name}-{k}") for k in ("bf16", "single", "same")}
        run = COMMON + ZERO + _parallel(tp, pp)
        plan += [("train", f"{name}-save", run + ["--bf16", "--train-iters", "2", "--save", ck[name]["bf16"]]),
                 ("convert", _convert(ck[name]["bf16"], ck[name]["single"], 1, 1)),
                 ("convert", _convert(ck[name]["bf16"], ck[name]["same"], tp, pp)),
                 ("train", f"{name}-native", run + ["--train-iters", "2", "--load", ck[name]["bf16"],
                                                    "--no-load-rng"]),
                 ("train", f"{name}-converted", run + ["--train-iters", "2", "--load", ck[name]["same"],
                                                       "--no-load-rng"])]
    records = _run_plan(tmp_path, plan, 4)
    for name, (tp, pp) in LAYOUTS.items():
        expected = _single_rank_main(ck[name]["single"])
        rounded = merge_full_params(records[f"{name}-save"])  # the bf16 weights the run saved
        assert any(not torch.equal(rounded[n], expected[n]) for n in expected), "the fp32 copy is not bf16's"
        for how in ("native", "converted"):
            recs = records[f"{name}-{how}"]
            for dp_rank in range(4 // (tp * pp)):
                got = merge_full_params(recs, dp_intra=dp_rank)
                assert got.keys() == expected.keys()
                for n, value in expected.items():
                    assert torch.equal(got[n], value), f"{name} {how}: DP rank {dp_rank}'s {n} is not the fp32 copy"
