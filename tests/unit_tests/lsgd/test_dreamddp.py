"""`dreamddp` end to end on spawned CPU/gloo ranks (tiny models), on TP2 x PP2 x 2 sites
(tied embeddings across the two stages) and on ZeRO-1 with DP_intra 2 x 2 sites. Each
layout is one spawn running three trainings in turn:

- H = 1 equals full parameter averaging after every backward: the same losses and
  parameters, bit for bit, as a reference synchronizer that averages this rank's whole
  main shard across sites after the backward, before the optimizer step;
- with H = 3, a slow simulated link and site 1's profiler clock running 3x fast (so the
  two sites measure very different times): every rank holds the same agreed profile
  (the maximum of what the ranks measured) and the same schedule; every unit is averaged
  in the slots the schedule gives it and at least once in any 3 consecutive iterations,
  across the switch from the profiling steps' schedule (a unit whose 3 iterations are up
  before its new slot comes is averaged besides the slot's units, in the first period
  only); the tied embedding and head copies are averaged in the same iterations; under ZeRO-1 the
  optimizer step's all-gather alone keeps the replicas of a site identical;
- at --train-iters the whole model is averaged, so every site ends with the same model.
Flag errors are checked without processes.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from megatron_lsgd.training.arguments import build_config, parse_args
from tests.unit_tests.harness import assert_replicas_identical, free_port, merge_full_params, spawn

COMMON = ["--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "5e-2",
          "--lr-decay-style", "constant", "--mock-data", "--vocab-size", "250", "--make-vocab-size-divisible-by", "32",
          "--log-interval", "1", "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
          "--seed", "7", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
          "--optimizer", "sgd", "--clip-grad", "0", "--num-sites", "2"]
LAYOUTS = {
    "tp2-pp2-sites2": (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    "zero1-dp2-sites2": (4, ["--use-distributed-optimizer", "--ddp-bucket-size", "5000"]),
}
H1 = ["--train-iters", "6", "--lsgd-algorithm", "dreamddp", "--lsgd-interval", "1"]
REFERENCE = ["--train-iters", "6", "--lsgd-algorithm", "test-full-average"]
# 2 profiling steps, then 3 periods of 3; stopped by --exit-interval (no final average)
SCHEDULED = ["--train-iters", "20", "--exit-interval", "11", "--lsgd-algorithm", "dreamddp", "--lsgd-interval", "3",
             "--lsgd-dreamddp-profile-steps", "2", "--simulate-inter-site-latency", "4",
             "--simulate-inter-site-bandwidth", "40"]


def _register_reference():
    from megatron_lsgd.core.lsgd.protocol import Synchronizer
    from megatron_lsgd.core.lsgd.registry import register, registered_algorithms

    class FullAverageAfterBackward(Synchronizer):
        """Test reference: average the whole main shard across sites after the backward"""

        name = "test-full-average"

        def _average(self):
            comm = self.ctx.comm
            handles = [comm.all_reduce_mean(m, async_op=True) for m in self.ctx.optimizer.views().main]
            for h in handles:
                h.wait()

        def after_forward_backward(self, iteration):
            self._average()

        def finish_training(self, iteration):
            self._average()
            self.ctx.optimizer.copy_main_to_model_params()

    if FullAverageAfterBackward.name not in registered_algorithms():
        register(FullAverageAfterBackward)


def _record(result, extra=None):
    model = result.model
    params = {}
    for name, p in model.global_named_parameters():
        params[name] = {"value": p.detach().float().clone(), "tp": bool(getattr(p, "tensor_model_parallel", False)),
                        "dim": getattr(p, "partition_dim", 0), "stride": getattr(p, "partition_stride", 1)}
    rec = {"losses": result.logged_losses, "params": params, "coords": model.pgs.coords, "comm": result.comm}
    return {**rec, **(extra or {})}


def _worker(rank: int, world: int, port: int, layout_args, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import pretrain_gpt
    from megatron_lsgd.core.lsgd.algorithms.dreamddp.plan import build_plan
    from megatron_lsgd.core.clock import Clock

    _register_reference()
    out = {"h1": _record(pretrain_gpt.main(COMMON + layout_args + H1)),
           "reference": _record(pretrain_gpt.main(COMMON + layout_args + REFERENCE))}
    if "--use-distributed-optimizer" in layout_args:  # the same site layout without ZeRO-1: split averages
        plain = [x for x in layout_args if x != "--use-distributed-optimizer"]
        out["h1_split"] = _record(pretrain_gpt.main(COMMON + plain + H1))
        out["reference_split"] = _record(pretrain_gpt.main(COMMON + plain + REFERENCE))
    site = rank // (world // 2)
    if site == 1:  # this site's clock (its profiler's readings) measures every time 3x longer than it is
        Clock.now = lambda self: 3.0 * time.perf_counter()
    result = pretrain_gpt.main(COMMON + layout_args + SCHEDULED)
    sync = result.synchronizer
    out["scheduled"] = _record(result, {
        "profile": dataclasses.asdict(sync.profile), "plan": dataclasses.asdict(sync.plan), "origin": sync.origin,
        "local": dataclasses.asdict(sync.local_measurement), "history": list(sync.history), "names": sync.names,
        "bootstrap": dataclasses.asdict(build_plan(sync._untimed_profile(), 3, "equal", False)),
        "stage": sync.stage})
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _run(layout):
    world, args = LAYOUTS[layout]
    with tempfile.TemporaryDirectory() as d:
        spawn(_worker, args=(world, free_port(), args, d), nprocs=world)
        records = [torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    return {key: [r[key] for r in records] for key in records[0]}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dreamddp_properties(layout):
    runs = _run(layout)

    # H = 1 is full parameter averaging after every backward, bit for bit
    h1, ref = runs["h1"], runs["reference"]
    assert h1[-1]["losses"] == ref[-1]["losses"] and len(h1[-1]["losses"]) == 6
    assert h1[-1]["losses"][-1] < h1[-1]["losses"][0]
    for site in (0, 1):
        a, b = merge_full_params(h1, site=site), merge_full_params(ref, site=site)
        assert all(torch.equal(a[n], b[n]) for n in a), f"site {site} differs from the reference"
    assert_replicas_identical(h1)  # the final average: every site ends with the same model
    if "h1_split" in runs:  # without ZeRO-1 each rank averages 1/DP_intra of a unit; the site gathers
        split, ref = runs["h1_split"], runs["reference_split"]
        assert split[-1]["losses"] == ref[-1]["losses"]
        for site in (0, 1):
            a, b = merge_full_params(split, site=site), merge_full_params(ref, site=site)
            assert all(torch.equal(a[n], b[n]) for n in a)
        assert_replicas_identical(split)
        assert split[0]["comm"]["bytes_sent"] < 0.6 * ref[0]["comm"]["bytes_sent"]  # half the unit each

    sched = runs["scheduled"]
    # one agreed profile and one schedule everywhere, although the sites measured differently
    assert all(r["plan"] == sched[0]["plan"] and r["profile"] == sched[0]["profile"] for r in sched)
    local = {}
    for r in sched:
        for name, b in r["local"]["backward_s"].items():
            local.setdefault(name, []).append((r["coords"].site, b))
    agreed = {u["name"]: u["backward_s"] for u in sched[0]["profile"]["units"]}
    for name, values in local.items():
        assert agreed[name] == max(b for _, b in values)
        by_site = [sorted(b for s, b in values if s == site) for site in (0, 1)]
        assert by_site[0] != by_site[1], f"{name}: the sites measured the same times"
    lat = [r["local"]["latency_s"] for r in sched]
    assert sched[0]["profile"]["latency_s"] == max(lat) and len(set(lat)) > 1

    # every unit averaged in the slots of its stage's schedule, and in any H consecutive iterations
    H, origin = 3, sched[0]["origin"]
    assert origin == 2  # 2 profiling steps
    plan = sched[0]["plan"]
    for r in sched:
        history = dict(r["history"])
        assert sorted(history) == list(range(11))
        bootstrap = r["bootstrap"]["stages"][r["stage"]]["slots"]  # the equal-number schedule
        for it in range(origin):  # while profiling (< H iterations: nothing overdue yet)
            assert list(history[it]) == bootstrap[it % H]
        slots = plan["stages"][r["stage"]]["slots"]
        for it in range(origin, 11):
            planned = slots[(it - origin) % H]
            assert set(planned) <= set(history[it])
            assert list(history[it]) == [n for n in r["names"] if n in history[it]]  # issued in backward order
            for n in set(history[it]) - set(planned):  # overdue at the switch: H iterations since its last average
                last = max([t for t in range(it) if n in history[t]], default=-1)
                assert it < origin + H and it - last == H, f"iteration {it}: {n} averaged out of schedule"
        for start in range(11 - H + 1):
            seen = {n for it in range(start, start + H) for n in history[it]}
            assert seen == set(r["names"]), f"iterations {start}..{start + H - 1}: {set(r['names']) - seen} missed"
        assert r["comm"]["bytes_sent"] > 0
    if layout.startswith("tp2-pp2"):
        first, last = plan["stages"][0]["slots"], plan["stages"][-1]["slots"]
        assert [("embedding" in s) for s in first] == [("output" in s) for s in last]  # tied copies together
        boot = sched[0]["bootstrap"]["stages"]
        assert [("embedding" in s) for s in boot[0]["slots"]] == [("output" in s) for s in boot[-1]["slots"]]
        for r0, r1 in zip([r for r in sched if r["stage"] == 0], [r for r in sched if r["stage"] == 1]):
            first_copy = [it for it, units in r0["history"] if "embedding" in units]
            assert first_copy and first_copy == [it for it, units in r1["history"] if "output" in units]
    # stopped by --exit-interval: sites differ (local SGD), but inside a site ZeRO-1's
    # all-gather in the optimizer step spread the averaged shards to every replica
    assert sched[-1]["losses"] and all(torch.isfinite(torch.tensor(sched[-1]["losses"])))
    if layout.startswith("zero1"):
        for site in (0, 1):
            a, b = merge_full_params(sched, site=site, dp_intra=0), merge_full_params(sched, site=site, dp_intra=1)
            assert all(torch.equal(a[n], b[n]) for n in a)
    s0, s1 = merge_full_params(sched, site=0), merge_full_params(sched, site=1)
    assert any(not torch.equal(s0[n], s1[n]) for n in s0)


def _small_worker(rank: int, world: int, port: int, profile_path: str, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import pretrain_gpt

    one_site = [a if a != "--num-sites" else "--num-sites" for a in COMMON]
    one_site[one_site.index("--num-sites") + 1] = "1"
    plain = pretrain_gpt.main(one_site + ["--train-iters", "4"])
    dream = pretrain_gpt.main(one_site + ["--train-iters", "4", "--lsgd-algorithm", "dreamddp", "--lsgd-interval", "2"])
    # A profile that promises a free link, on a link with 25 ms latency: the exposed time
    # measured in the first 2 periods is far above the prediction, so the run re-profiles
    # after step 4 (the next check would come after step 8).
    drift = pretrain_gpt.main(COMMON + ["--train-iters", "6", "--lsgd-algorithm", "dreamddp", "--lsgd-interval", "2",
                                        "--lsgd-dreamddp-profile", profile_path,
                                        "--lsgd-dreamddp-reprofile-interval", "4",
                                        "--simulate-inter-site-latency", "25"])
    sync = drift.synchronizer
    torch.save({"plain": _record(plain), "dream": _record(dream),
                "drift": _record(drift, {"profile": dataclasses.asdict(sync.profile),
                                         "plan": dataclasses.asdict(sync.plan), "reprofiles": sync.reprofiles,
                                         "origin": sync.origin, "history": list(sync.history)})},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_one_site_is_plain_training_and_drift_reschedules(tmp_path):
    import json

    from megatron_lsgd.core.lsgd.algorithms.dreamddp.profile import Profile, UnitProfile

    units = [UnitProfile(n, 0, 1e-3, 0, 0) for n in ("embedding", "layers.0", "layers.1", "output")]
    path = tmp_path / "free_link.json"
    path.write_text(json.dumps({"profile": Profile(units, [0.0], 0.0, 0.0, False).to_dict()}))
    spawn(_small_worker, args=(2, free_port(), str(path), str(tmp_path)), nprocs=2)
    recs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    # S = 1 (two data-parallel ranks in one site): dreamddp leaves training untouched
    plain, dream = [r["plain"] for r in recs], [r["dream"] for r in recs]
    assert plain[-1]["losses"] == dream[-1]["losses"]
    a, b = merge_full_params(plain), merge_full_params(dream)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert dream[-1]["comm"]["bytes_sent"] == 0
    # drift: re-profiled once at the end of step 4, from step 5 on a new period with the measured link
    drift = [r["drift"] for r in recs]
    assert all(d["reprofiles"] == 1 and d["origin"] == 4 for d in drift)
    assert drift[0]["plan"] == drift[1]["plan"] and drift[0]["profile"] == drift[1]["profile"]
    assert 0.02 < drift[0]["profile"]["latency_s"] < 0.2  # the probes saw the 25 ms
    assert drift[0]["profile"]["source"] == "re-profiled at iteration 4"
    history = dict(drift[0]["history"])
    slots = drift[0]["plan"]["stages"][0]["slots"]
    assert [list(history[it]) for it in range(4, 6)] == [slots[0], slots[1]]
    assert [list(history[it]) for it in range(4)] == [["output", "layers.1", "layers.0", "embedding"]] * 4
    assert_replicas_identical(drift)


BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "1", "--train-iters", "10", "--lr", "1e-3", "--mock-data", "--vocab-size", "100",
        "--num-sites", "2"]


def _config(extra):
    return build_config(parse_args(BASE + extra), 2)


@pytest.mark.parametrize("extra,message", [
    (["--lsgd-algorithm", "dreamddp", "--lsgd-dreamddp-profile-steps", "0"], "--lsgd-dreamddp-profile-steps"),
    (["--lsgd-algorithm", "dreamddp", "--lsgd-interval", "4", "--lsgd-dreamddp-reprofile-interval", "6"],
     "--lsgd-dreamddp-reprofile-interval 6 must be a multiple of --lsgd-interval 4"),
    (["--lsgd-algorithm", "dreamddp", "--lsgd-dreamddp-reprofile-interval", "-1"],
     "--lsgd-dreamddp-reprofile-interval"),
    (["--lsgd-algorithm", "dreamddp", "--lsgd-dreamddp-reprofile-tolerance", "0"],
     "--lsgd-dreamddp-reprofile-tolerance"),
    (["--lsgd-algorithm", "dreamddp", "--lsgd-dreamddp-profile", "/nonexistent/p.json"],
     "--lsgd-dreamddp-profile /nonexistent/p.json: cannot read"),
    (["--lsgd-algorithm", "dreamddp", "--lsgd-compression", "int8"],
     "--lsgd-compression int8 is not supported by --lsgd-algorithm dreamddp"),
    (["--lsgd-algorithm", "diloco", "--lsgd-dreamddp-profile-steps", "2"],
     "--lsgd-dreamddp-profile-steps needs --lsgd-algorithm dreamddp"),
])
def test_bad_flags_name_the_flag(extra, message):
    with pytest.raises(ValueError, match=message):
        _config(extra)


def test_profile_file_must_fit_the_model(tmp_path):
    from megatron_lsgd.core.lsgd.algorithms.dreamddp.profile import Profile, UnitProfile

    units = [UnitProfile(n, 0, 1e-3, 1024, 1) for n in ("embedding", "layers.0", "layers.1", "output")]
    path = tmp_path / "p.json"
    import json

    path.write_text(json.dumps({"profile": Profile(units, [0.0], 0.01, 1e-9, False).to_dict()}))
    cfg = _config(["--lsgd-algorithm", "dreamddp", "--lsgd-dreamddp-profile", str(path)])
    assert cfg.lsgd.algo.profile == str(path)
    with pytest.raises(ValueError, match="no backward time for layers.2, layers.3"):
        build_config(parse_args([a if a != "2" else "4" for a in BASE[:2]] + BASE[2:] + [
            "--lsgd-algorithm", "dreamddp", "--lsgd-dreamddp-profile", str(path)]), 2)
    with pytest.raises(ValueError, match="written for 1 pipeline stages"):
        build_config(parse_args(BASE + ["--pipeline-model-parallel-size", "2", "--lsgd-algorithm", "dreamddp",
                                        "--lsgd-dreamddp-profile", str(path)]), 4)


@pytest.mark.slow
def test_resume_is_bit_exact_and_keeps_the_schedule(tmp_path):
    """ZeRO-1 x 2 sites, H = 3, the schedule from a profile file (so the uninterrupted and the
    killed run have the same one); killed after the checkpoint of iteration 4 (mid-period)
    and resumed *without* the file: the checkpoint's profile and schedule are used (measured
    times on this machine would give another schedule), and the run reproduces the
    uninterrupted one bit for bit."""
    import json

    from megatron_lsgd.core.lsgd.algorithms.dreamddp.profile import Profile, UnitProfile, read_profile_file
    from megatron_lsgd.training.checkpointing.checkpointer import HOLD_ENV
    from tests.unit_tests.checkpointing.launch import TINY, kill, read, run, start_forked, wait_for
    from tests.unit_tests.checkpointing.test_resume_exact import ITERS, _check_resumed, _tracker

    # A slow link: nothing hides, no bubble filling; the search gives {output}, {layers.1},
    # {layers.0, embedding}. Measured times (a fast local link) would give another schedule.
    units = [UnitProfile(n, 0, 1e-3, 0, 0) for n in ("embedding", "layers.0", "layers.1", "output")]
    profile_path = tmp_path / "profile.json"
    profile_path.write_text(json.dumps({"profile": Profile(units, [0.0], 0.05, 1e-9, False).to_dict()}))
    layout = ["--num-sites", "2", "--use-distributed-optimizer", "--global-batch-size", "8",
              "--hidden-dropout", "0", "--attention-dropout", "0", "--lsgd-algorithm", "dreamddp",
              "--lsgd-interval", "3"]
    common = TINY + layout + ["--train-iters", str(ITERS), "--save-interval", "4"]
    ref_text = run(common + ["--save", str(tmp_path / "ref"), "--lsgd-dreamddp-profile", str(profile_path)], 4,
                   str(tmp_path / "ref.log"))
    assert "slot 1: output  ->" in ref_text and "slot 3: layers.0, embedding  ->" in ref_text
    # the profile and the schedule are written next to the logs (here --save: no --json-log)
    written = tmp_path / "ref" / "dreamddp_profile.json"
    assert json.loads(written.read_text())["schedule"]["stages"][0]["slots"] == [
        ["output"], ["layers.1"], ["layers.0", "embedding"]]
    assert read_profile_file(str(written))["backward_ms"]["layers.0"] == pytest.approx(1.0)

    ckpt = str(tmp_path / "ckpt")
    proc = start_forked(common + ["--save", ckpt, "--lsgd-dreamddp-profile", str(profile_path)], 4,
                        str(tmp_path / "killed.log"), env={HOLD_ENV: "8"})
    wait_for(lambda: os.path.exists(os.path.join(ckpt, ".holding_8")), proc, str(tmp_path / "killed.log"))
    kill(proc)
    assert _tracker(ckpt) == 4

    text = run(common + ["--save", ckpt, "--load", ckpt], 4, str(tmp_path / "resumed.log"))
    assert "restored from the checkpoint" in text and "profiling step" not in text
    schedule = [line for line in ref_text.splitlines() if line.startswith("    slot ")]
    assert schedule and schedule == [line for line in text.splitlines() if line.startswith("    slot ")]
    _check_resumed(tmp_path, str(tmp_path / "ref.log"), str(tmp_path / "resumed.log"), 4)
    assert "profiling step" not in read(str(tmp_path / "killed.log"))


@pytest.mark.slow
def test_checkpoint_saved_while_profiling_resumes_the_profiling(tmp_path):
    """2 sites, 3 profiling steps, stopped (and saved) after step 2 with H = 2, resumed with
    H = 4: the third profiling step runs with H = 4's equal-number schedule (one unit per
    slot, not the checkpoint's two), and the schedule is computed from steps 2 and 3, the
    sample of step 2 coming from the checkpoint (step 1 is left out)."""
    import re

    from tests.unit_tests.checkpointing.launch import TINY, run

    ckpt = str(tmp_path / "ckpt")
    common = TINY + ["--num-sites", "2", "--global-batch-size", "4", "--hidden-dropout", "0", "--attention-dropout",
                     "0", "--lsgd-algorithm", "dreamddp", "--lsgd-dreamddp-profile-steps", "3", "--train-iters", "6",
                     "--save", ckpt]
    first = run(common + ["--lsgd-interval", "2", "--exit-interval", "2"], 2, str(tmp_path / "first.log"))
    assert "dreamddp schedule" not in first and re.search(r"iteration +2/.*profiling step: 2", first)
    text = run(common + ["--lsgd-interval", "4", "--load", ckpt], 2, str(tmp_path / "resumed.log"))
    step3 = re.search(r"iteration +3/.*", text).group(0)
    assert "H: 4 | slot: 3 | synced units: 1 " in step3  # the log line is written after the schedule
    assert "profiled over steps [2, 3]" in text and "periods start at iteration 4" in text
