"""--lsgd-dreamddp-schedule pins a schedule: a profiling run's dreamddp_profile.json, given to
a second run of the same seed, makes it train exactly as the first (same losses, same
weights, the same units averaged in every iteration), without timing anything; the log says
which schedule ran. A schedule that cannot be the one the file describes is one error line."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from megatron_lsgd.training.arguments import build_config, parse_args
from tests.unit_tests.harness import free_port, join_as_rank, spawn
from tests.unit_tests.lsgd.test_dreamddp import COMMON

# 2 profiling steps, then periods of 3 (a real-clock profile: its schedule is what it is)
RUN = COMMON + ["--train-iters", "9", "--lsgd-algorithm", "dreamddp", "--lsgd-interval", "3",
                "--lsgd-dreamddp-profile-steps", "2", "--simulate-inter-site-latency", "4",
                "--simulate-inter-site-bandwidth", "40"]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    join_as_rank(rank, world, port)
    import torch.distributed as dist

    import pretrain_gpt
    from tests.unit_tests.harness import _record

    first = pretrain_gpt.main(RUN + ["--json-log", os.path.join(out_dir, "first", "log.jsonl")])
    dist.barrier()
    # the ranks' own log (forked from the suite's server, their stdout is not the test's to capture)
    with open(os.path.join(out_dir, f"pinned.rank{rank}.log"), "w") as log, contextlib.redirect_stdout(log):
        pinned = pretrain_gpt.main(RUN + ["--lsgd-dreamddp-schedule", os.path.join(out_dir, "first",
                                                                                   "dreamddp_profile.json")])
    for name, result in (("first", first), ("pinned", pinned)):
        _record(result, os.path.join(out_dir, f"{name}.rank{rank}.pt"))
        torch.save({"history": list(result.synchronizer.history), "plan": result.synchronizer.plan.to_dict(),
                    "origin": result.synchronizer.origin},
                   os.path.join(out_dir, f"{name}.sync{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_pinned_schedule_reproduces_the_profiling_run(tmp_path):
    os.makedirs(tmp_path / "first")
    spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    printed = "".join((tmp_path / f"pinned.rank{rank}.log").read_text() for rank in range(2))
    for rank in range(2):
        a, b = (torch.load(tmp_path / f"{n}.rank{rank}.pt", weights_only=False) for n in ("first", "pinned"))
        assert a["losses"] == b["losses"] and len(a["losses"]) == 9
        for name in a["params"]:
            assert torch.equal(a["params"][name]["value"], b["params"][name]["value"]), name
        sa, sb = (torch.load(tmp_path / f"{n}.sync{rank}.pt", weights_only=False) for n in ("first", "pinned"))
        assert sa == sb and sa["origin"] == 2, (sa, sb)
    assert "schedule read from" in printed and "dreamddp_profile.json (pinned" in printed


def test_a_schedule_file_that_does_not_fit_is_refused(tmp_path):
    import json

    path = tmp_path / "s.json"
    units = [{"name": n, "stage": 0, "backward_ms": 1.0, "bytes": 4, "collectives": 1, "comm_ms": 0.1}
             for n in ("output", "layers.1", "layers.0", "embedding")]
    profile = {"format": 1, "source": "x", "measured_steps": [], "link": {"latency_ms": 1, "ms_per_MB": 1},
               "tied_embeddings": False, "stages": [{"stage": 0, "tail_ms": 0}], "units": units}
    from megatron_lsgd.core.lsgd.algorithms.dreamddp.profile import PROFILE_FORMAT
    profile["format"] = PROFILE_FORMAT
    names = [u["name"] for u in units]
    stage = {"names": names, "slots": [names[:2], names[2:], []], "searched": [], "filled": [],
             "predicted_exposed_ms": [0, 0, 0], "nodes": 1}
    doc = {"profile": profile, "schedule": {"interval": 3, "method": "dfs", "bubble_fill": True, "stages": [stage]},
           "origin_iteration": 2, "reprofiles": 0}
    base = COMMON + ["--lsgd-algorithm", "dreamddp", "--train-iters", "9", "--lsgd-dreamddp-schedule", str(path)]

    def refused(doc_, extra=()):
        path.write_text(json.dumps(doc_) if isinstance(doc_, dict) else doc_)
        with pytest.raises(ValueError) as err:
            build_config(parse_args(base + list(extra)), 2)
        return str(err.value)

    path.write_text(json.dumps(doc))
    build_config(parse_args(base + ["--lsgd-interval", "3"]), 2)  # fits
    assert "written for --lsgd-interval 3, this run has 2" in refused(doc, ["--lsgd-interval", "2"])
    assert "re-profiles (field 'reprofiles')" in refused({**doc, "reprofiles": 1}, ["--lsgd-interval", "3"])
    assert "field 'schedule' is damaged" in refused({**doc, "schedule": {"interval": 3}}, ["--lsgd-interval", "3"])
    assert "holds a profile but no schedule" in refused({"profile": profile}, ["--lsgd-interval", "3"])
    assert "not JSON" in refused('{"profile": {', ["--lsgd-interval", "3"])
    assert "exclude each other" in refused(doc, ["--lsgd-interval", "3", "--lsgd-dreamddp-reprofile-interval", "3"])
    assert "not this model's" in refused(doc, ["--lsgd-interval", "3", "--num-layers", "4"])
