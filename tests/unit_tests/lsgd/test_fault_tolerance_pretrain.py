"""pretrain_gpt.py with --lsgd-fault-tolerance torchft (docs/fault_tolerance.md).

Each site is its own job (its own torch.distributed world, `--lsgd-site k`), a torchft
lighthouse runs in the test process. What the runs leave is read from their per-site
checkpoints (<save>/site<k>/iter_*: model, optimizer shard, synchronizer state, RNG) and
their log lines. Sites are SIGKILLed whole (every rank and the launcher) mid-round and
restarted as torchrun --max-restarts would (from their checkpoint) or fresh.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import pytest

from tests.unit_tests.checkpointing.launch import (TINY, Job, assert_same, finish_together, kill, load_tree, losses,
                                                  read, run, start, start_together)

torchft = pytest.importorskip("torchft", reason="torchft is not installed (pip install -e \".[ft]\")")
os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse (in this process) logs every quorum at info

from tools.benchmarks.elastic.chaos import check_digests, read_digests  # noqa: E402
from tools.benchmarks.elastic.ft_site import start_lighthouse  # noqa: E402

H = 2
# Sites that die or come back are paced (each rank sleeps to make its step PACE times as long):
# rounds of about a second, so a kill lands mid-round and a returning site finds rounds left.
PACE = "12"
BOOKKEEPING = "membership"  # the torchft committed-round count: a plain run has none


def _job(sites: int, lighthouse: str = "", min_sites: int = 1, extra=(), algorithm=("--lsgd-algorithm", "diloco"),
         interval: int = H) -> list:
    rounds = [] if algorithm == SYNC else ["--lsgd-interval", str(interval)]  # sync: a round is a step
    args = TINY + ["--num-sites", str(sites), *algorithm, *rounds, "--save-interval", str(interval), *extra]
    if lighthouse:
        args += ["--lsgd-fault-tolerance", "torchft", "--lsgd-lighthouse", lighthouse, "--lsgd-min-sites",
                 str(min_sites), "--lsgd-ft-timeout", "20", "--lsgd-ft-max-wait", "120"]
    return args


def _site(args: list, site: int) -> list:
    return args + ["--lsgd-site", str(site)]


def _iteration(log: str) -> int:
    found = re.findall(r"iteration\s+(\d+)/", read(log)) if os.path.exists(log) else []
    return int(found[-1]) if found else 0


def _until(condition, what: str, procs=(), timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        for p in procs:
            assert p.poll() in (None, 0), f"a site ended with {p.poll()} before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _checkpoint(save: str, site: int, iteration: int) -> dict:
    """A site's files at an iteration, its torchft bookkeeping left out."""
    tree = load_tree(os.path.join(save, f"site{site}", f"iter_{iteration:07d}"))
    for content in tree.values():
        content.pop(BOOKKEEPING, None)
    return tree


def _round_state(tree: dict) -> dict:
    """What every site holds after a round, by file name without the site: the model and the
    synchronizer's anchor, outer momentum and error feedback (the inner optimizer's moments
    and the RNG streams are each site's own)."""
    out = {}
    for name, content in tree.items():
        key = re.sub(r"site_\d{3}", "site_k", name)
        if "params" in content:
            out[key] = content["params"]
        elif "synchronizer" in content:
            out[key] = {k: content["synchronizer"][k] for k in ("outer", "reducer")}
    return out


def _position(save: str, site: int, iteration: int):
    """(job samples, this site's samples, its LR schedule) from the site's metadata.json."""
    with open(os.path.join(save, f"site{site}", f"iter_{iteration:07d}", "metadata.json")) as f:
        meta = json.load(f)
    return meta["consumed_samples"], meta["site_consumed_samples"][site], meta["site_schedulers"][site]


def _saved_iterations(save: str, site: int) -> list:
    names = os.listdir(os.path.join(save, f"site{site}")) if os.path.isdir(os.path.join(save, f"site{site}")) else []
    return sorted(int(n[len("iter_"):]) for n in names if n.startswith("iter_"))


HOOKS = "tests/unit_tests/lsgd/ft_pretrain_hooks.py"  # pretrain_gpt.py with a test's timing of a site
HOOKS_ENTRY = "tests.unit_tests.lsgd.ft_pretrain_hooks"  # the same, as a forked rank's entry (launch.Job)
DILOCOX = ("--lsgd-algorithm", "dilocox")
COCODC = ("--lsgd-algorithm", "cocodc", "--lsgd-fragments", "2", "--lsgd-cocodc-schedule", "round-robin")
SYNC = ("--lsgd-algorithm", "sync")
EDIT = ("--lsgd-algorithm", "edit")
DREAMDDP = ("--lsgd-algorithm", "dreamddp")
# dreamddp's schedule from a profile file (the elastic and the plain run then have one schedule),
# or measured with a schedule that does not depend on the times: consecutive blocks of equal size,
# nothing added. With 2 layers and H = 2 both give slot 0 {output, layers.1}, slot 1 {layers.0, embedding}.
PROFILE = "{profile}"  # (the test writes the file)
EQUAL = ["--lsgd-dreamddp-scheduler", "equal", "--lsgd-dreamddp-no-bubble-fill"]
# With H = 4 the same schedules average one unit a step: output, layers.1, layers.0, embedding.
FIRST_SLOT = {2: ("output", "layers.1"), 4: ("output",)}
# dreamddp's kill tests: steps paced longer (its steps are the shortest), so that on a loaded
# machine the restarted site still finds rounds left (at PACE, site 0 once trained 40 steps in
# 4.7 s and had finished before the restarted site asked for a quorum)
DREAMDDP_PACE = ["--slow-factor", "30"]


def _with_profile(args: list, tmp_path) -> list:
    """`args` with PROFILE replaced by a dreamddp profile file for its pipeline stages: every
    unit's backward 1 ms, a slow link (as test_dreamddp.py's resume test writes one)."""
    if PROFILE not in args:
        return args
    from megatron_lsgd.core.lsgd.algorithms.dreamddp.profile import Profile, UnitProfile

    stages = int(args[args.index("--pipeline-model-parallel-size") + 1]) if "--pipeline-model-parallel-size" in args \
        else 1
    units = [UnitProfile(n, 0 if n in ("embedding", "layers.0") else stages - 1, 1e-3, 0, 0)
             for n in ("embedding", "layers.0", "layers.1", "output")]
    path = tmp_path / "dreamddp_profile.json"
    path.write_text(json.dumps({"profile": Profile(units, [0.0] * stages, 0.05, 1e-9, False).to_dict()}))
    return [str(path) if a == PROFILE else a for a in args]


def _unmeasured(tree: dict) -> dict:
    """`tree` without what dreamddp measured on the wall clock (its profile, timing samples and
    predicted exposed times), which differs between any two runs; everything else must match."""
    for content in tree.values():
        sync = content.get("synchronizer") if isinstance(content, dict) else None
        if isinstance(sync, dict) and "plan" in sync and "profile" in sync:
            for key in ("profile", "samples", "monitor", "monitor_exposed_s"):
                sync.pop(key, None)
            for stage in sync["plan"]["stages"]:
                stage.pop("exposed_s", None)
    return tree


@pytest.mark.slow
@pytest.mark.parametrize("layout,algorithm,interval", [
    # p2p inside a site; error feedback
    (["--pipeline-model-parallel-size", "2", "--lsgd-compression", "int8"], ("--lsgd-algorithm", "diloco"), H),
    # the mean applied a round late, issued after the next round's quorum; sparse all-gather
    (["--tensor-model-parallel-size", "2", "--lsgd-compression", "topk-2bit"], DILOCOX, H),
    # a quorum per fragment sync; the all-to-all quantized mean
    (["--pipeline-model-parallel-size", "2", "--lsgd-compression", "int4", "--lsgd-quantized-mean", "alltoall",
      "--train-iters", "10"], COCODC, 4),
    # a quorum and a gradient mean per step; each site's 2 ranks split its traffic (gathered in the site after)
    (["--lsgd-compression", "int8"], SYNC, H),
    # a quorum per sync, its norm gather and per-unit exchanges in the forward on the quorum's
    # group; the tied embedding's clip across stages; a last, partial round as a closing exchange
    (["--pipeline-model-parallel-size", "2", "--train-iters", "7"], EDIT, H),
    # a round per period, its per-unit averages launched from backward on the quorum's group, the
    # profile file's agreement inside the first round; the tied embedding's two stages; a checkpoint
    # every H steps; the closing average of the whole model after a last, partial round
    (["--pipeline-model-parallel-size", "2", "--train-iters", "7", "--lsgd-dreamddp-profile", PROFILE], DREAMDDP, H),
    # the profiling steps, then the link probes and the profile's agreement inside the round they
    # end (the switch); each site's 2 ZeRO-1 ranks average their own shards
    (["--use-distributed-optimizer", "--ddp-bucket-size", "5000", "--train-iters", "9"] + EQUAL, DREAMDDP, H),
], ids=["diloco-pp2-int8", "dilocox-tp2-topk", "cocodc-pp2-int4", "sync-dp2-int8", "edit-pp2-tied",
        "dreamddp-pp2-tied", "dreamddp-zero1-profiled"])
def test_without_faults_every_number_equals_the_plain_run(tmp_path, layout, algorithm, interval):
    # 2 sites of 2 ranks each. Every checkpointed tensor of both sites and every logged loss
    # must equal the run without fault tolerance.
    extra = _with_profile(["--train-iters", "6"] + layout, tmp_path)
    iters = int(extra[len(extra) - 1 - extra[::-1].index("--train-iters") + 1])
    plain = run(_job(2, extra=extra + ["--save", str(tmp_path / "plain")], algorithm=algorithm, interval=interval), 4,
                str(tmp_path / "plain.log"))
    lighthouse = start_lighthouse(2, join_timeout_ms=60_000)  # every round waits for both sites
    try:
        args = _job(2, lighthouse.address(), 2, extra + ["--save", str(tmp_path / "ft")], algorithm, interval)
        jobs = [Job(_site(args, site), 2, str(tmp_path / f"ft{site}.log")) for site in range(2)]
        finish_together(start_together(jobs), jobs)
    finally:
        lighthouse.shutdown()
    reference = _unmeasured(load_tree(str(tmp_path / "plain" / f"iter_{iters:07d}")))
    elastic = {}
    for site in range(2):
        elastic.update(_unmeasured(_checkpoint(str(tmp_path / "ft"), site, iters)))
    assert sorted(elastic) == sorted(reference)
    assert_same(elastic, reference)
    for site in range(2):
        assert losses(read(str(tmp_path / f"ft{site}.log"))) == losses(plain)
    assert len(losses(plain)) == iters


@pytest.mark.slow
def test_a_killed_site_is_rolled_back_waited_for_and_healed(tmp_path):
    iters = 24  # kills near iterations 5 and 9; then rounds enough for both returning sites to come
    # 3 sites of 2 ZeRO-1 ranks each, H = 2, --lsgd-min-sites 2; every site saves every round.
    # 1. site 2 is SIGKILLed mid-round: sites 0 and 1 roll the round back and go on alone;
    # 2. then site 1 is killed: site 0 is below the floor and waits, training nothing;
    # 3. site 1 restarts from its checkpoint, site 2 fresh: both are healed from site 0.
    # The lighthouse would accept one site: the floor is the sites' own.
    save = str(tmp_path / "ckpt")
    lighthouse = start_lighthouse(1, heartbeat_timeout_ms=1000, join_timeout_ms=5000)
    logs = {s: str(tmp_path / f"site{s}.log") for s in range(3)}
    procs = {}
    extra = ["--use-distributed-optimizer", "--train-iters", str(iters), "--save", save, "--load", save,
             "--simulate-slow-ranks", "0,1,2,3,4,5", "--slow-factor", PACE]
    args = _job(3, lighthouse.address(), 2, extra)
    try:
        procs = {s: start(_site(args, s), 2, logs[s]) for s in range(3)}
        # A site that starts late joins by healing: first, every site has saved a round and is past it.
        def together():
            saved = set.intersection(*(set(_saved_iterations(save, s)) for s in range(3)))
            return saved and all(_iteration(logs[s]) > min(saved) for s in range(3))

        _until(together, "every site to save a round and go on", procs.values())
        kill(procs.pop(2))
        failed = re.compile(r"site 0: round (\d+) was not committed \(lost site 2")
        _until(lambda: failed.search(read(logs[0])), "site 0 to roll back the round", procs.values())
        lost = int(failed.search(read(logs[0])).group(1))  # rounds attempted, i.e. the round's index
        _until(lambda: _iteration(logs[0]) > (lost + 1) * H and _iteration(logs[1]) > (lost + 1) * H,
               "sites 0 and 1 past the next round", procs.values())
        kill(procs.pop(1))
        _until(lambda: "site 0 waits for --lsgd-min-sites 2" in read(logs[0]), "site 0 to wait", procs.values())
        # The site's last rank prints the step lines: the round's last may come after the wait line.
        _until(lambda: _iteration(logs[0]) % H == 0, "site 0's last line before the wait", procs.values())
        waiting_at = _iteration(logs[0])
        time.sleep(3.0)  # it stays there, at a round's start: nothing trained alone
        assert _iteration(logs[0]) == waiting_at
        procs[1] = start(_site(args, 1), 2, logs[1] + ".restart")
        fresh = args[:args.index("--load")] + args[args.index("--load") + 2:]
        procs[2] = start(_site(fresh, 2), 2, logs[2] + ".restart")
        _until(lambda: all(p.poll() is not None for p in procs.values()), "the job's end", timeout=600)
        assert {s: p.returncode for s, p in procs.items()} == {0: 0, 1: 0, 2: 0}
    finally:
        for p in procs.values():
            kill(p)
        lighthouse.shutdown()
    text = {s: read(logs[s]) for s in range(3)}

    # 1. The lost round left the survivors' anchor, outer momentum and model as they were.
    for s in (0, 1):
        assert len(re.findall(r"was not committed \(lost site 2", text[s])) == 1, text[s]
        before, after = _checkpoint(save, s, (lost - 1) * H), _checkpoint(save, s, lost * H)
        assert_same(_round_state(after), _round_state(before), f"site {s}")
    # ... and the next round went on from there exactly as a job that starts from that state
    # (sites 0 and 1 alone, nothing lost) does: a reference resumed from their checkpoints.
    ref = str(tmp_path / "reference")
    for s in (0, 1):
        os.makedirs(os.path.join(ref, f"site{s}"))
        shutil.copytree(os.path.join(save, f"site{s}", f"iter_{lost * H:07d}"),
                        os.path.join(ref, f"site{s}", f"iter_{lost * H:07d}"))
        with open(os.path.join(ref, f"site{s}", "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(lost * H))
    lighthouse = start_lighthouse(2, join_timeout_ms=60_000)
    try:
        ref_args = _job(3, lighthouse.address(), 2, [a if a != save else ref for a in extra] + ["--exit-interval",
                                                                                               str(H)])
        jobs = [Job(_site(ref_args, s), 2, str(tmp_path / f"ref{s}.log")) for s in (0, 1)]
        finish_together(start_together(jobs), jobs, timeout=300)
    finally:
        lighthouse.shutdown()
    for s in (0, 1):
        assert_same(_checkpoint(ref, s, (lost + 1) * H), _checkpoint(save, s, (lost + 1) * H), f"site {s}")

    # 2. The floor: site 0 waited alone, naming who is missing (and trained nothing meanwhile, above).
    assert re.search(r"site 0 waits for --lsgd-min-sites 2 sites .*in the quorum: 0\); missing: 1,2", text[0]), text[0]

    # 3. Both returning sites were healed and agree with site 0 at every later round both
    # saved. (On a loaded machine a site can miss a quorum by its heartbeat and be healed in
    # turn: seen once, site 0 healed at committed round 5 from the returning sites, which had
    # saved iteration 14 without it; the rounds it was in still agree.)
    restarted = {s: read(logs[s] + ".restart") for s in (1, 2)}
    for s in (1, 2):
        assert "rejoined at committed round" in restarted[s], restarted[s]
        later = [i for i in _saved_iterations(save, s) if i > waiting_at and i in _saved_iterations(save, 0)]
        assert later and later[-1] == iters
        for i in later:
            assert_same(_round_state(_checkpoint(save, s, i)), _round_state(_checkpoint(save, 0, i)),
                        f"site {s} at iteration {i}")
            # ... at the data position and schedule an uninterrupted site would have
            assert _position(save, s, i) == _position(save, 0, i)


def _outer_state(tree: dict) -> dict:
    """Each rank file's anchors and outer momenta by name without the site (what every site
    holds alike under dilocox and the streaming family: each keeps its own local progress
    and error feedback)."""
    return {re.sub(r"site_\d{3}", "site_k", name): content["synchronizer"]["outer"]
            for name, content in tree.items() if "synchronizer" in content}


def _model(tree: dict) -> dict:
    """Each rank file's model by name without the site (what every site holds alike under sync,
    whose every step applies the same mean; its error feedback is each site's own)."""
    return {re.sub(r"site_\d{3}", "site_k", name): content["params"] for name, content in tree.items()
            if "params" in content}


def _last_averages(tree: dict) -> dict:
    """Each rank file's digests of every unit's value right after its last average (what every
    site holds alike under dreamddp, whose models differ between averages)."""
    return {re.sub(r"site_\d{3}", "site_k", name): content["synchronizer"]["averaged_digests"]
            for name, content in tree.items() if "synchronizer" in content}


UNIT_PREFIXES = {"embedding": ("embedding.",), "layers.0": ("layers.0.",), "layers.1": ("layers.1.",),
                 "output": ("final_layernorm.", "output_layer.")}


def _units(model: dict, units) -> dict:
    """The parameters of `units` (sync units' names) in each rank file's model (`_model`)."""
    prefixes = tuple(p for u in units for p in UNIT_PREFIXES[u])
    out = {f: {k: v for k, v in params.items() if k.startswith(prefixes)} for f, params in model.items()}
    assert all(out.values()), sorted(next(iter(model.values())))
    return out


def _without_digests(tree: dict) -> dict:
    """dreamddp keeps the digests of the last averages only where --lsgd-ft-digests asks for them."""
    for content in tree.values():
        if "synchronizer" in content:
            content["synchronizer"].pop("averaged_digests", None)
    return tree


def _last_line_before(text: str, marker: str) -> int:
    """The iteration of the last step line printed before `marker`."""
    return _iteration_of(text[:text.index(marker)])


def _iteration_of(text: str) -> int:
    found = re.findall(r"iteration\s+(\d+)/", text)
    return int(found[-1]) if found else 0


@pytest.mark.slow
@pytest.mark.parametrize("algorithm,interval,extra,die,shared,nproc", [
    # the round-3 quorum: the mean of round 2's Δ, in flight for the whole round, is lost
    (DILOCOX, H, ["--lsgd-compression", "int8"], {"LSGD_TEST_DIE_AFTER_QUORUM": "3"}, _outer_state, 1),
    # quorums: the process's first step, then one per fragment sync: the third sync is lost
    (COCODC, 4, ["--lsgd-compression", "int4"], {"LSGD_TEST_DIE_AFTER_QUORUM": "4"}, _outer_state, 1),
    # a quorum per step: step 5's gradient mean is lost, and that step is applied on no site
    (SYNC, H, ["--lsgd-compression", "int8"], {"LSGD_TEST_DIE_AFTER_QUORUM": "5"}, _model, 1),
    # a quorum per sync (at the step after its H-th): the second sync is lost in its forward
    # pass, after unit 0 took its outer step: every unit goes back to its anchor (dying before
    # unit 2's instead, the site may already have sent every unit's exchange, and site 0 then
    # commits the round: seen under load)
    (EDIT, H, ["--lsgd-compression", "int8"], {"LSGD_TEST_DIE_AT_UNIT": "2:1"}, _outer_state, 1),
    # sites of 2 ZeRO-1 ranks: only site 1's rank 1 dies, entering its second sync's norm
    # gather, so on site 0 rank 0's gather succeeds and rank 1's fails: both must still roll
    # every unit back (the clip's sum over the site's shards would otherwise wait forever)
    (EDIT, H, ["--use-distributed-optimizer", "--ddp-bucket-size", "5000"],
     {"LSGD_TEST_DIE_AT_GATHER": "2", "LSGD_TEST_DIE_RANKS": "1"}, _outer_state, 2),
    # a round per period of H = 4, one unit average a step (output, layers.1, layers.0, embedding):
    # site 1 dies before its 7th, in the second round's third step, once that round's averages of
    # output and layers.1 have landed on both sites: site 0 must undo them (H = 4: rounds enough
    # after the rollback for the restarted site to come on a loaded machine)
    (DREAMDDP, 4, ["--lsgd-dreamddp-profile", PROFILE] + EQUAL + DREAMDDP_PACE, {"LSGD_TEST_DIE_AT_AVERAGE": "7"},
     _last_averages, 1),
    # sites of 2 ZeRO-1 ranks, only site 1's rank 1 dies there: on site 0 rank 1's average fails
    # while rank 0 goes on with its own shards; the site's one decision undoes the same units on both
    (DREAMDDP, 4, ["--use-distributed-optimizer", "--ddp-bucket-size", "5000", "--lsgd-dreamddp-profile", PROFILE]
     + EQUAL + DREAMDDP_PACE, {"LSGD_TEST_DIE_AT_AVERAGE": "7", "LSGD_TEST_DIE_RANKS": "1"}, _last_averages, 2),
], ids=["dilocox", "cocodc", "sync", "edit", "edit-zero1-one-rank-dies", "dreamddp", "dreamddp-zero1-one-rank-dies"])
def test_a_killed_site_under_a_delayed_or_fragment_mean_rolls_back_and_heals(tmp_path, algorithm, interval, extra,
                                                                             die, shared, nproc):
    # 2 sites of 1 rank (`nproc`), --lsgd-min-sites 1, every site saves every H steps. Site 1 dies
    # (SIGKILL) right after a quorum, before that round's reduction: site 0 logs one `lost
    # site 1` line and goes on alone exactly as a job resumed from its state after the
    # rollback does. Site 1 comes back fresh (a process started with the others, held until
    # site 0 has trained a round alone), is healed and holds site 0's anchors and outer
    # momenta at every later checkpoint, and the job's final model.
    extra = _with_profile(extra, tmp_path)
    save = str(tmp_path / "ckpt")
    iters = 10 * interval
    lighthouse = start_lighthouse(1, heartbeat_timeout_ms=1000, join_timeout_ms=5000)
    logs = {s: str(tmp_path / f"site{s}.log") for s in range(2)}
    digests = str(tmp_path / "digests")  # what every site holds alike, at every committed round
    # (`extra` last: an entry may pace its sites otherwise)
    base = ["--train-iters", str(iters), "--save", save, "--lsgd-ft-digests", digests,
            "--simulate-slow-ranks", "0,1", "--slow-factor", PACE] + extra
    args = _job(2, lighthouse.address(), 1, base, algorithm, interval)
    release = str(tmp_path / "release")
    procs, others = {}, []
    marker, back = "was not committed (lost site 1", "site 0: sites now 0,1 (were 0)"
    try:
        # Site 1 never trains alone (its own floor); site 0 starts once site 1's torchft manager
        # is up, so that the two meet at site 0's first quorum.
        victim_args = [a if a != save else str(tmp_path / "victim") for a in args]  # (the held site's lock)
        others.append(start(_site(victim_args, 1) + ["--lsgd-min-sites", "2"], nproc, logs[1], script=HOOKS,
                            env={**die, "LSGD_TEST_READY_FILE": str(tmp_path / "victim.ready")}))
        procs[0] = start(_site(args, 0), nproc, logs[0], script=HOOKS,
                         env={"LSGD_TEST_HOLD_UNTIL": str(tmp_path / "victim.ready")})
        others.append(start(_site(args, 1) + ["--lsgd-min-sites", "2"], nproc, logs[1] + ".restart",
                            env={"LSGD_TEST_HOLD_UNTIL": release}, script=HOOKS))  # fresh, as a restarted process
        _until(lambda: marker in read(logs[0]), "site 0 to roll back", procs.values())
        assert others[0].wait(timeout=120) != 0
        after = min(i for i in range(0, iters + 1, interval) if i >= _last_line_before(read(logs[0]), marker))
        _until(lambda: _iteration(logs[0]) > after + interval, "site 0 a round past the rollback", procs.values())
        open(release, "w").close()
        procs[1] = others.pop()
        _until(lambda: all(p.poll() is not None for p in procs.values()), "the job's end", timeout=600)
        assert {s: p.returncode for s, p in procs.items()} == {0: 0, 1: 0}
    finally:
        for p in list(procs.values()) + others:
            kill(p)
        lighthouse.shutdown()
    text0, restarted = read(logs[0]), read(logs[1] + ".restart")
    assert text0.count(marker) == 1 and back in text0[text0.index(marker):], text0
    if algorithm == SYNC:  # the step whose mean was lost is applied on no site: site 0 skipped it
        assert "| skipped iterations: 1 |" in text0, text0[-600:]
    if algorithm == EDIT:  # the lost sync moved no anchor: site 0's outer state is that of the save before it
        lost_at = _last_line_before(text0, marker) // interval * interval
        assert_same(_outer_state(_checkpoint(save, 0, lost_at)), _outer_state(_checkpoint(save, 0, lost_at - interval)),
                    "site 0's outer state across the lost sync")
    if algorithm == DREAMDDP:  # the lost round's first step averaged slot 0's units, landed on both sites:
        # site 0 holds them as before that average, i.e. as at the round's start; the later units
        # (landed, failed or never sent) are back at their value before their own step's average,
        # which a step of the round had moved
        lost_at = _last_line_before(text0, marker) // interval * interval
        before, after_loss = _model(_checkpoint(save, 0, lost_at - interval)), _model(_checkpoint(save, 0, lost_at))
        first = FIRST_SLOT[interval]
        later = [u for u in UNIT_PREFIXES if u not in first]
        assert_same(_units(after_loss, first), _units(before, first), "site 0's slot-0 units across the lost round")
        with pytest.raises(AssertionError):
            assert_same(_units(after_loss, later), _units(before, later))
    agreed = check_digests(read_digests(digests))  # both sites' (the killed process's included)
    assert agreed["disagreements"] == [] and agreed["rounds_checked"] >= 4, agreed
    # site 0's last checkpoint before site 1 came back
    rolled_back = text0.index(marker)
    joined = _iteration_of(text0[:text0.index(back, rolled_back)])  # (site 1 may also have come after site 0 began)
    alone = joined // interval * interval
    assert alone > after, f"site 1 came back too soon ({joined}) for a round alone after {after}"

    # Alone after the rollback, site 0 went on as a job resumed from its state then does.
    # That reference (site 0 alone to the job's end) also shows the job's end: a fresh site 1
    # that comes when site 0 has trained its last round (held at its closing quorum) waits
    # at its floor, takes the final state at site 0's closing quorum and stops at once.
    ref = str(tmp_path / "reference")
    os.makedirs(os.path.join(ref, "site0"))
    shutil.copytree(os.path.join(save, "site0", f"iter_{after:07d}"), os.path.join(ref, "site0", f"iter_{after:07d}"))
    with open(os.path.join(ref, "site0", "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(after))
    closing, late_go = str(tmp_path / "closing"), str(tmp_path / "late")
    ref_logs = [str(tmp_path / f"ref{s}.log") for s in range(2)]
    lighthouse = start_lighthouse(1, heartbeat_timeout_ms=1000, join_timeout_ms=5000)
    ranks = None
    try:
        ref_args = _job(2, lighthouse.address(), 1, [a if a != save else ref for a in extra + [
            "--train-iters", str(iters), "--save", save]], algorithm, interval)
        jobs = [Job(_site(ref_args + ["--load", ref], 0), nproc, ref_logs[0], {"LSGD_TEST_HOLD_CLOSING_UNTIL": closing},
                    HOOKS_ENTRY),
                Job(_site(ref_args, 1) + ["--lsgd-min-sites", "2"], nproc, ref_logs[1], {"LSGD_TEST_HOLD_UNTIL": late_go},
                    HOOKS_ENTRY)]
        ranks = start_together(jobs)
        _until(lambda: os.path.exists(closing + ".reached"), "site 0 at the job's end", [ranks])
        open(late_go, "w").close()
        _until(lambda: "site 1 waits for --lsgd-min-sites 2" in read(ref_logs[1]), "site 1 to wait", [ranks])
        open(closing, "w").close()
        finish_together(ranks, jobs, timeout=300)
        ranks = None
    finally:
        if ranks is not None:
            kill(ranks)
        lighthouse.shutdown()
    late = read(ref_logs[1])
    assert "site 1: the job had finished at committed round" in late and _iteration_of(late) == 0, late[-2000:]
    ends = [{re.sub(r"site_\d{3}", "site_k", k): v["params"] for k, v in _checkpoint(ref, s, iters).items()
             if "params" in v} for s in range(2)]
    assert ends[0]
    assert_same(ends[1], ends[0], "the late site's final model")
    assert_same(_without_digests(_checkpoint(ref, 0, alone)), _without_digests(_checkpoint(save, 0, alone)), "site 0")

    # The restarted site was healed and holds site 0's anchors and momenta from then on.
    assert "rejoined at committed round" in restarted, restarted
    # Its log counts from the heal: its first step line's tokens are one step's (4 samples of
    # 32 tokens per rank of a site), its traffic summary counts the steps it trained.
    first = re.search(r"elapsed time per iteration \(ms\): ([0-9.]+) .*?tokens/s: ([0-9.]+)",
                      restarted[restarted.index("rejoined at committed round"):])
    assert abs(float(first.group(1)) / 1e3 * float(first.group(2)) - 128 * nproc) < 6.4 * nproc, first.group(0)
    membership = [line for line in (text0 + restarted).splitlines()
                  if "sites now" in line or "not committed" in line or "rejoined" in line]
    assert f"in {iters - joined} steps" in restarted, (joined, membership, restarted[-600:])  # (flaked once under load)
    later = [i for i in _saved_iterations(save, 1) if i > joined]
    assert later and later[-1] == iters
    for i in later:
        assert_same(shared(_checkpoint(save, 1, i)), shared(_checkpoint(save, 0, i)), f"iteration {i}")
        assert _position(save, 1, i) == _position(save, 0, i)
    final = [{re.sub(r"site_\d{3}", "site_k", k): v["params"] for k, v in _checkpoint(save, s, iters).items()
              if "params" in v} for s in range(2)]
    assert final[0]
    assert_same(final[1], final[0], "the final model")  # the job's final model on both sites
