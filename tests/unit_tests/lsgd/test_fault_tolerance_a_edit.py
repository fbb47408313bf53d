"""a-edit with --lsgd-fault-tolerance torchft (docs/fault_tolerance.md, "a-edit").

Sites of different speeds on the deterministic virtual clock (MEGATRON_LSGD_TEST_VIRTUAL_CLOCK:
site 0 steps in 1 s, site 1 in 2 s; a sync every 4 s), each site its own job, a torchft
lighthouse in the test process (as test_fault_tolerance_pretrain.py). A meeting is a round:
its quorum is the barrier, its report gather and sync run on the quorum's group.
"""

from __future__ import annotations

import os
import re

import pytest

from tests.unit_tests.checkpointing.launch import (TINY, Job, assert_same, finish_together, kill, load_tree, read, run,
                                                  start, start_together)

torchft = pytest.importorskip("torchft", reason="torchft is not installed (pip install -e \".[ft]\")")
os.environ.setdefault("RUST_LOG", "warn")

from megatron_lsgd.core.lsgd.algorithms.edit.a_edit import VIRTUAL_CLOCK_ENV  # noqa: E402
from tests.unit_tests.lsgd.test_fault_tolerance_pretrain import (HOOKS, PACE, _checkpoint, _iteration_of,  # noqa: E402
                                                                 _until)
from tools.benchmarks.elastic.chaos import check_digests, read_digests  # noqa: E402
from tools.benchmarks.elastic.ft_site import start_lighthouse  # noqa: E402

SPEEDS = {VIRTUAL_CLOCK_ENV: "1,2"}  # virtual seconds per step of site 0 and site 1
A_EDIT = TINY + ["--num-sites", "2", "--global-batch-size", "8", "--hidden-dropout", "0", "--attention-dropout", "0",
                 "--lsgd-algorithm", "a-edit", "--lsgd-aedit-interval-seconds", "4", "--lsgd-edit-ema-warmup", "2"]
# One line per own step: its iteration, loss, the job's agreed progress, every site's steps at
# the last meeting, and the synchronizer's meetings and syncs.
LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?learning rate: (\S+) \|.*?\| lm loss: ([0-9.E+-]+) \|.*?\| "
                  r"site: (\d+) \| job iteration: (\d+)/\d+ \|(?:.*?site steps at last meeting: ([0-9/]+) \|)?"
                  r".*?syncs: (\d+) \|.*?meetings: (\d+) ")
LOST_ROUND = "was not committed (lost site 1"
BUDGET = re.compile(r"budget of (\d+) samples reached \((\d+) consumed, site steps (\d+)/(\d+)\)")
DONE = re.compile(r"done: (\d+) iterations on site (\d+)")


def _elastic(lighthouse: str, min_sites: int) -> list:
    return ["--lsgd-fault-tolerance", "torchft", "--lsgd-lighthouse", lighthouse, "--lsgd-min-sites", str(min_sites),
            "--lsgd-ft-timeout", "20", "--lsgd-ft-max-wait", "120"]


def _lines(text: str) -> dict:
    """site -> the tuple of every step line's numbers, in order."""
    out: dict = {}
    for it, lr, loss, site, job, steps, syncs, meetings in LINE.findall(text):
        out.setdefault(int(site), []).append((int(it), lr, loss, int(job), steps, int(syncs), int(meetings)))
    return out


@pytest.mark.slow
def test_a_edit_without_faults_equals_the_plain_run(tmp_path):
    # 2 sites of 2 pipeline stages (tied embeddings); 12 global batches of 8 = 24 site steps of
    # 4 samples: meetings after site steps (4, 2), (8, 4), (12, 6) and, on quotas, (16, 8).
    # Every step line (loss, job progress, meetings, syncs), the stop and every final tensor
    # of both sites must equal the run without fault tolerance.
    args = A_EDIT + ["--pipeline-model-parallel-size", "2", "--train-iters", "12"]
    plain = run(args + ["--save", str(tmp_path / "plain")], 4, str(tmp_path / "plain.log"), env=SPEEDS)
    assert "(96 consumed, site steps 16/8)" in plain
    lighthouse = start_lighthouse(2, join_timeout_ms=60_000)  # every meeting waits for both sites
    try:
        ft = args + ["--save", str(tmp_path / "ft")] + _elastic(lighthouse.address(), 2)
        jobs = [Job(ft + ["--lsgd-site", str(site)], 2, str(tmp_path / f"ft{site}.log"), dict(SPEEDS))
                for site in range(2)]
        finish_together(start_together(jobs), jobs)
    finally:
        lighthouse.shutdown()
    texts = [read(str(tmp_path / f"ft{site}.log")) for site in range(2)]
    want = _lines(plain)
    assert [len(want[0]), len(want[1])] == [16, 8] and want[0][-1][-1] == 4  # four meetings
    for site in range(2):
        assert _lines(texts[site]) == {site: want[site]}, site
        assert "(96 consumed, site steps 16/8)" in texts[site]
    reference = load_tree(str(tmp_path / "plain" / "iter_0000012"))
    elastic = {}
    for site in range(2):
        elastic.update(_checkpoint(str(tmp_path / "ft"), site, 12))
    assert sorted(elastic) == sorted(reference)
    assert_same(elastic, reference)


@pytest.mark.slow
@pytest.mark.parametrize("die,died_after,last,rolled_back_syncs,lost", [
    # between meetings, as its step 6 starts: no round is lost, site 0's next quorum leaves it
    # out; its last sync is the first meeting's (step 4)
    ({"LSGD_TEST_DIE_AT_STEP": "6"}, 5, 4, 0, "site 0: sites now 0 (were 0,1)"),
    # in its second sync's forward pass, unit 0 synced, before unit 1's mean is applied (so
    # it never sends unit 3's: site 0's exchange of it fails whatever the timing): its last
    # sync is the second meeting's (after its step 8), which site 0 rolls back
    ({"LSGD_TEST_DIE_AT_UNIT": "2:1"}, 8, 8, 1, LOST_ROUND),
    # entering its second meeting's report gather (its all-gathers: its process's first
    # quorum's report, then per meeting a report and the norms): site 0's gather fails, that
    # meeting is lost before it decided a sync, so site 1's last sync is the first (step 4);
    # it dies before it logs its step 8
    ({"LSGD_TEST_DIE_AT_GATHER": "4"}, 7, 4, 0, LOST_ROUND),
], ids=["between-meetings", "in-the-sync", "in-the-report-gather"])
def test_a_killed_a_edit_site_is_rolled_back_healed_and_the_budget_counted_once(tmp_path, die, died_after, last,
                                                                                rolled_back_syncs, lost):
    # 2 sites of 1 rank, --lsgd-min-sites 1 for site 0 (2 for site 1: it never meets alone),
    # site 1 the fast one (1 virtual s a step, site 0 2 s; a sync every 4 s), 40 global batches
    # of 8 = 80 site steps of 4 samples (enough for the restarted site to come before the end
    # on a loaded machine). Site 1 dies (SIGKILL) in its second interval or meeting (`die`):
    # site 0 logs it once (`lost`: in a meeting it loses that round, every unit back at its
    # anchor, the interval restarted) and goes on alone. Site 1 comes back fresh (held until site 0 has met
    # alone), takes one step of its own, is healed at its process's first quorum, which is
    # site 0's next meeting, and takes part in it; it goes on from its own position at the
    # last sync it took part in (`last`), not site 0's. Both end with the job's final model,
    # the digests of every committed round agree, and every sample was counted once: the
    # job's count at the end is both sites' own stream positions together.
    save, digests = str(tmp_path / "ckpt"), str(tmp_path / "digests")
    speeds = {VIRTUAL_CLOCK_ENV: "2,1"}
    lighthouse = start_lighthouse(1, heartbeat_timeout_ms=1000, join_timeout_ms=5000)
    logs = {s: str(tmp_path / f"site{s}.log") for s in range(2)}
    args = A_EDIT + ["--train-iters", "40", "--save", save, "--lsgd-ft-digests", digests,
                     "--simulate-slow-ranks", "0,1", "--slow-factor", PACE] + _elastic(lighthouse.address(), 1)
    release, ready = str(tmp_path / "release"), str(tmp_path / "victim.ready")
    procs, others = {}, []
    marker, back = lost, "site 0: sites now 0,1 (were 0)"
    try:
        victim = [a if a != save else str(tmp_path / "victim") for a in args]
        others.append(start(victim + ["--lsgd-site", "1", "--lsgd-min-sites", "2"], 1, logs[1], script=HOOKS,
                            env={**speeds, **die, "LSGD_TEST_READY_FILE": ready}))
        procs[0] = start(args + ["--lsgd-site", "0"], 1, logs[0], script=HOOKS,
                         env={**speeds, "LSGD_TEST_HOLD_UNTIL": ready})
        others.append(start(args + ["--lsgd-site", "1", "--lsgd-min-sites", "2"], 1, logs[1] + ".restart",
                            env={**speeds, "LSGD_TEST_HOLD_UNTIL": release}, script=HOOKS))
        _until(lambda: marker in read(logs[0]), "site 0 to roll back", procs.values())
        assert others[0].wait(timeout=120) != 0
        lost_at = _iteration_of(read(logs[0]))
        _until(lambda: _iteration_of(read(logs[0])) >= lost_at + 2, "site 0 to meet alone", procs.values())
        open(release, "w").close()
        procs[1] = others.pop()
        _until(lambda: all(p.poll() is not None for p in procs.values()), "the job's end", timeout=600)
        assert {s: p.returncode for s, p in procs.items()} == {0: 0, 1: 0}
    finally:
        for p in list(procs.values()) + others:
            kill(p)
        lighthouse.shutdown()
    text0, killed, restarted = read(logs[0]), read(logs[1]), read(logs[1] + ".restart")
    assert text0.count(marker) == 1 and back in text0[text0.index(marker):], text0[-3000:]
    # a lost sync's round puts site 0's syncs counter back (with the anchors and momenta)
    syncs = [line[5] for line in _lines(text0)[0]]
    assert sum(b < a for a, b in zip(syncs, syncs[1:])) == rolled_back_syncs, syncs
    # the restarted site: healed at a meeting, then on from its own iteration at its last sync
    assert "rejoined at committed round" in restarted, restarted[-3000:]
    # ... at its process's first quorum, after one step of its own (whose line is not printed:
    # the heal replaced it), not after an interval's (4 steps)
    assert not _lines(restarted[:restarted.index("rejoined at committed round")]), restarted[-3000:]
    healed = _lines(restarted[restarted.index("rejoined at committed round"):])[1]
    assert _lines(killed)[1][-1][0] == died_after and healed[0][0] == last + 1, (_lines(killed)[1][-1], healed[:3])
    agreed = check_digests(read_digests(digests))
    assert agreed["disagreements"] == [] and agreed["rounds_checked"] >= 4, agreed
    # the job's progress never goes back, across the loss and the heal
    for lines in (_lines(text0)[0], healed):
        progress = [line[3] for line in lines]
        assert progress == sorted(progress), progress
    # the budget met, each sample counted once: both sites' stop lines agree, and the count is
    # both sites' own positions (4 samples a step) at the end
    ends = [BUDGET.search(text0), BUDGET.search(restarted)]
    assert ends[0] and ends[1] and ends[0].groups() == ends[1].groups(), (ends, text0[-2000:], restarted[-2000:])
    budget, consumed, steps0, steps1 = map(int, ends[0].groups())
    assert budget == 320 and budget - 8 < consumed <= budget
    done = {int(site): int(it) for it, site in DONE.findall(text0 + restarted)}
    assert done == {0: steps0, 1: steps1} and consumed == 4 * (steps0 + steps1), (done, consumed)
    final = [{re.sub(r"site_\d{3}", "site_k", k): v["params"] for k, v in _checkpoint(save, s, consumed // 8).items()
              if "params" in v} for s in range(2)]
    assert final[0]
    assert_same(final[1], final[0], "the final model")
