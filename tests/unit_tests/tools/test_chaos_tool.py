"""tools/benchmarks/elastic/chaos.py without processes: the flags every site gets, the digest check
(every site's digest of the same rank at the same round), the final validation loss and the
report's arithmetic. Running it is a benchmark (docs/fault_tolerance.md), not a test."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tools.benchmarks.elastic.chaos import (check_digests, final_validation, job_setup, load_baseline, main, save_baseline,
                                    site_argv, summarize_pretrain)

ARGS = SimpleNamespace(sites=3, min_sites=2, timeout=20.0, faults=["site"], fault_every=120.0)


def test_every_site_gets_fault_tolerance_digests_a_final_validation_and_resumable_checkpoints():
    argv = site_argv(ARGS, ["--train-iters", "40", "--save-interval", "8"], "/out", "http://lh:1")
    flags = dict(zip(argv[::2], argv[1::2]))
    assert flags["--lsgd-fault-tolerance"] == "torchft" and flags["--lsgd-lighthouse"] == "http://lh:1"
    assert flags["--num-sites"] == "3" and flags["--lsgd-min-sites"] == "2" and flags["--lsgd-ft-timeout"] == "20.0"
    assert flags["--lsgd-ft-digests"] == "/out/digests"
    assert flags["--eval-interval"] == "40" and flags["--eval-iters"] == "4"  # a validation at the end
    assert flags["--save"] == flags["--load"] == "/out/ckpt"  # a restarted site resumes from its own
    plain = site_argv(ARGS, ["--train-iters", "40", "--eval-iters", "2", "--eval-interval", "10"], "/out", "x")
    assert "--save" not in plain and plain.count("--eval-iters") == 1  # the job's own validation is kept
    with pytest.raises(ValueError, match="--train-iters"):
        site_argv(ARGS, [], "/out", "x")


def _records(*rounds):
    return [{"round": r, "attempted": a, "digest": d, **({"final": True} if f else {})} for r, a, d, f in rounds]


def test_digests_must_agree_rank_by_rank_at_every_round():
    good = {"site0_rank0.jsonl": _records((1, 1, "a", 0), (2, 3, "b", 0), (2, 3, "e", 1)),
            "site1_rank0.jsonl": _records((2, 3, "b", 0), (2, 3, "e", 1)),  # healed at round 2: nothing before
            "site0_rank1.jsonl": _records((1, 1, "c", 0)), "site1_rank1.jsonl": _records((1, 1, "c", 0))}
    # round 1 is held twice at rank 1, round 2 twice at rank 0, and both sites' ends
    assert check_digests(good) == {"rounds_checked": 2, "records_compared": 6, "disagreements": []}
    bad = dict(good, **{"site1_rank1.jsonl": _records((1, 1, "x", 0))})
    assert check_digests(bad)["disagreements"] == ["rank1.jsonl round 1"]
    end = dict(good, **{"site1_rank0.jsonl": _records((2, 3, "b", 0), (2, 3, "f", 1))})
    assert check_digests(end)["disagreements"] == ["rank0.jsonl round 2 (final)"]


def test_the_report():
    base = {"wall_s": 100.0, "codes": {0: 0, 1: 0, 2: 0}, "kills": [], "late": [],
            "texts": {0: " validation loss at iteration 40 | lm loss value: 5.000000E+00 |"},
            "digests": {"site0_rank0.jsonl": _records((10, 10, "z", 1))}}
    chaos = {"wall_s": 125.0, "codes": {0: 0, 1: 0, 2: -9}, "late": [2],
             "kills": [{"site": 2, "t": 0.0, "rejoined_s": 30.0}, {"site": 1, "t": 50.0, "rejoined_s": 40.0},
                       {"site": 2, "t": 90.0}],
             "texts": {0: " validation loss at iteration 20 | lm loss value: 6.0E+00 |\n"
                          " validation loss at iteration 40 | lm loss value: 5.25E+00 |"},
             "digests": {"site0_rank0.jsonl": _records((7, 8, "q", 0), (9, 10, "w", 1)),
                         "site1_rank0.jsonl": _records((9, 10, "w", 1))}}
    report = summarize_pretrain(ARGS, base, chaos)
    assert report["faults_injected"] == report["faults_survived"] == 3 and report["job_finished"]
    assert report["faults_by_kind"] == {"site": 3} and report["network"] == "loopback"
    assert (report["rounds_committed"], report["rounds_attempted"], report["baseline_rounds"]) == (9, 10, 10)
    assert report["goodput"] == round(0.9 * 100 / 125, 3)
    assert report["rejoin_s"] == {"mean": 35.0, "max": 40.0} and report["killed_sites_rejoined"] == 2
    assert (report["final_validation_loss"], report["baseline_final_validation_loss"]) == (5.25, 5.0)
    assert final_validation({0: "nothing"}) is None
    # a site that ended with an error (not one stopped for restarting too late): nothing survived
    failed = summarize_pretrain(ARGS, base, dict(chaos, codes={0: 0, 1: 0, 2: 1}, late=[]))
    assert failed["job_finished"] is False and failed["faults_survived"] == 0
    disagreeing = dict(chaos, digests=dict(chaos["digests"], **{"site1_rank0.jsonl": _records((9, 10, "v", 1))}))
    assert summarize_pretrain(ARGS, base, disagreeing)["faults_survived"] == 0


def test_bad_command_lines(capsys):
    assert main(["--sites", "2", "--min-sites", "2"]) == 2
    assert main(["--target", "toy", "--", "--train-iters", "4"]) == 2
    assert main(["--", "--num-layers", "2"]) == 2
    assert capsys.readouterr().err.count("error:") == 3
    for argv, says in ((["--faults", "cut"], "--faults cut needs --wan-rate-mbit"),
                       (["--faults", "site,boom"], "'boom' is not one of site, rank, freeze, cut"),
                       (["--kill", "site", "--faults", "rank"], "--kill and --faults: give one"),
                       (["--target", "toy", "--wan-rate-mbit", "100", "--"], "are for --target pretrain"),
                       (["--faults", "freeze", "--freeze-s", "0"], "--freeze-s 0: must be > 0")):
        assert main(argv if "--" in argv else argv + ["--", "--train-iters", "4"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and says in err and len(err.splitlines()) == 1, err


def test_fault_kinds_are_taken_in_turn_and_a_freeze_or_a_cut_ends_on_time(tmp_path):
    """--faults site,freeze,cut gives site, freeze, cut, site, ...; a frozen site's processes
    are stopped until its time is up, then continued, and it is not hit again before --timeout
    has passed (its first collective after it is back fails within that); a cut asks the WAN
    to take its link down, then up."""
    import signal
    import subprocess
    import time

    from tools.benchmarks.elastic.chaos import PretrainSite, fault_kind

    assert [fault_kind(["site", "freeze", "cut"], i) for i in range(4)] == ["site", "freeze", "cut", "site"]

    def stopped(pid, want=True):
        """Whether the process is (want) or is not stopped, within 5 s: a signal lands a little later."""
        deadline = time.monotonic() + 5
        while True:
            with open(f"/proc/{pid}/stat") as f:
                is_stopped = f.read().rsplit(")", 1)[1].split()[0] == "T"
            if is_stopped == want or time.monotonic() > deadline:
                return is_stopped
            time.sleep(0.02)

    calls = []
    wan = SimpleNamespace(set_link=lambda i, up: calls.append((i, up)))
    site = PretrainSite(1, [], SimpleNamespace(timeout=5.0), str(tmp_path / "site1.log"), wan)
    (tmp_path / "site1.log").write_text("")
    site.proc = subprocess.Popen(["sh", "-c", "sleep 30 & wait"], start_new_session=True)
    try:
        time.sleep(0.3)
        site.trained = True
        assert site.training(100.0)
        site.disturb("freeze", until=110.0)
        assert stopped(site.proc.pid) and not site.training(200.0)
        assert not site.restore_if_due(109.0) and stopped(site.proc.pid)
        assert site.restore_if_due(110.0) and not stopped(site.proc.pid, want=False)
        site.trained = True  # it logs a step again
        assert not site.training(114.0) and site.training(115.0)  # --timeout after it is back
        site.disturb("cut", until=120.0)
        assert calls == [(1, False)] and not site.training(119.0)
        assert site.restore_if_due(130.0) and calls == [(1, False), (1, True)]
    finally:
        site.proc.send_signal(signal.SIGCONT)
        site.kill_site()


def test_a_baseline_is_kept_for_later_runs_of_the_same_job_only(tmp_path, capsys):
    args = SimpleNamespace(target="pretrain", sites=3, min_sites=2, timeout=20.0, ranks_per_site=1)
    job = ["--train-iters", "40"]
    base = {"wall_s": 100.0, "codes": {0: 0, 1: 0, 2: 0}, "kills": [], "late": [],
            "texts": {0: "a", 1: "b", 2: "c"}, "digests": {"site0_rank0.jsonl": _records((10, 10, "z", 1))}}
    save_baseline(str(tmp_path), job_setup(args, job), base)
    assert load_baseline(str(tmp_path), job_setup(args, job)) == base  # site numbers are ints again
    with pytest.raises(ValueError, match="differs in: job"):
        load_baseline(str(tmp_path), job_setup(args, ["--train-iters", "80"]))
    with pytest.raises(ValueError, match="differs in: sites"):
        load_baseline(str(tmp_path), job_setup(SimpleNamespace(**dict(vars(args), sites=4)), job))
    wan = SimpleNamespace(**dict(vars(args), wan_rate_mbit=100.0, wan_delay_ms=20.0))
    with pytest.raises(ValueError, match="differs in: wan_delay_ms, wan_rate_mbit"):  # a loopback baseline
        load_baseline(str(tmp_path), job_setup(wan, job))
    assert main(["--baseline-from", str(tmp_path / "nowhere"), "--", "--train-iters", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "--baseline-from" in err and "baseline.json" in err
    for damaged, says in (('{"setup": {', "damaged"), ("[1]", "JSON list"), ('{"setup": {}}', "lacks its setup or run")):
        (tmp_path / "baseline.json").write_text(damaged)
        with pytest.raises(ValueError, match=says):
            load_baseline(str(tmp_path), job_setup(args, job))


def test_what_each_fault_cost_the_survivors_and_the_timeline():
    from tools.benchmarks.elastic.chaos import fault_costs, timeline

    def started(t):
        return {"log": '{"started": 0}', "t": t}

    def quorum(t, sites, healed=False):
        return [{"ft": "quorum_asked", "committed": 3, "t": t - 1},
                {"ft": "quorum", "id": 1, "sites": sites, "committed": 3, "healed": healed, "t": t}]

    healed = {"log": "site 1 rejoined at committed round 3: ...", "t": 0}
    lost = {"log": "site 0: round 4 was not committed (lost site 2: x); rolled back", "t": 0}
    records = {
        0: [started(0), dict(lost, t=11), dict(lost, t=12)],  # two rounds lost to the fault at t=10
        1: [started(0), *quorum(1, [0, 1, 2]), dict(lost, t=11), *quorum(13, [0, 1], healed=True), dict(healed, t=13),
            dict(lost, t=21)],  # healed after taking part: a second heal for the fault at t=10
        # its own heal, logged just after the next kill (the tool kills when it reads the logs)
        2: [started(0), started(12), *quorum(20.5, [1, 2], healed=True), dict(healed, t=20.5)],
    }
    kills = [{"site": 2, "t": 10.0, "starts_before": 0}, {"site": 0, "t": 20.0, "starts_before": 0}]
    costs = fault_costs(records, kills, sites=3)
    assert costs["heals"] == 2 and costs["heals_per_fault"] == 1.0
    assert costs["survivor_heals"] == 1 and costs["faults_with_a_survivor_healed"] == 1
    assert costs["faults_with_a_survivor_two_rounds_not_committed"] == 1
    assert costs["restarted_first_quorum_held_every_site"] == "0 of 1"  # site 0's restart never came
    assert costs["survivors_failed_apart_s"] is None  # no round-failure records (ft_site writes them)
    records[0].append({"ft": "not_committed", "attempted": 4, "sites": [0, 1, 2], "why": "closed", "t": 11.0})
    records[1].append({"ft": "not_committed", "attempted": 4, "sites": [0, 1, 2], "why": "timed out", "t": 14.5})
    assert fault_costs(records, kills, sites=3)["survivors_failed_apart_s"] == \
        {"median": 3.5, "max": 3.5, "over_1s": 1, "faults": 1}
    lines = timeline(records, kills)
    assert lines[0].split()[1:] == ["site0", "started", "(its", "manager", "is", "up)"]
    assert any("chaos  killed site 2" in line for line in lines)
    assert any("site2  quorum id 1 sites 1,2 at committed 3 HEALED (asked 1.00 s before)" in line for line in lines)
