"""The benchmark's arithmetic on known logs, and one real (tiny) run over two namespaces."""

import json
import os
import subprocess
import sys

import pytest

from tools.benchmarks.wan import wan_report
from tools.wan.netns import WanError, list_namespaces
from tools.wan.preflight import probe
from tools.wan.topology import REPO_ROOT


def fake_log(tokens_per_interval, seconds, bytes_per_interval=0.0, exposed=0.0, losses=(5.0, 4.0, 3.0), rss=100.0):
    records, wall = [], 0.0
    for i, (s, loss) in enumerate(zip(seconds, losses)):
        wall += s
        records.append({"iteration": 2 * (i + 1), "interval_iters": 2, "elapsed_s": s, "wall_s": wall,
                        "tokens": tokens_per_interval, "tokens_per_s": tokens_per_interval / s,
                        "losses": {"lm loss": loss}, "inter_site_bytes": bytes_per_interval,
                        "exposed_comm_s": exposed, "sync_stats": {}})
    return records + [{"event": "done", "iteration": 2 * len(seconds), "peak_rss_mb": rss, "wall_s": wall}]


def test_summary_skips_warmup_for_speed_but_not_for_bytes():
    m = wan_report.summarize(fake_log(1000, [10.0, 1.0, 1.0], bytes_per_interval=400.0, exposed=0.5))
    assert m["tokens_per_s"] == pytest.approx(1000.0)  # the slow first interval is warm-up
    assert m["updates_per_s"] == pytest.approx(2.0) and m["updates"] == 6
    assert m["inter_site_bytes_per_step"] == pytest.approx(200.0)
    assert m["exposed_comm_s_per_step"] == pytest.approx(0.25)
    assert m["loss"] == 3.0 and m["peak_rss_mb"] == 100.0
    assert [p["tokens"] for p in m["curve"]] == [1000, 2000, 3000]
    waited = fake_log(1000, [1.0, 1.0, 1.0])
    waited[-1]["wall_s"] = 5.0  # the run ends when its last in-flight update is applied (acco/dpu)
    assert wan_report.summarize(waited)["run_wall_s"] == 5.0
    with pytest.raises(ValueError, match="logged no interval"):
        wan_report.summarize([{"event": "done"}])


def test_non_lockstep_sites_log_their_own_tokens_and_add_up():
    # a-edit with a 2x straggler: site 0 logs 3 intervals of 1000 tokens per second, site 1
    # 2 intervals at half the rate; the job's throughput is the sum, as for the ceiling
    fast = [dict(r, site=0) for r in fake_log(1000, [1.0, 1.0, 1.0], bytes_per_interval=100.0, exposed=0.2)]
    slow = [dict(r, site=1) for r in fake_log(1000, [2.0, 2.0, 2.0], bytes_per_interval=100.0, exposed=0.0,
                                              losses=(6.0, 5.0, 4.0))]
    m = wan_report.summarize(sorted(fast + slow, key=lambda r: r.get("wall_s", 99)))
    assert m["tokens_per_s"] == pytest.approx(1000.0 + 500.0)
    assert m["site_iterations"] == [6, 6] and m["site_tokens_per_s"] == pytest.approx([1000.0, 500.0])
    assert m["exposed_comm_s_per_step"] == pytest.approx((0.1 + 0.0) / 2)
    assert m["loss"] == pytest.approx((3.0 + 4.0) / 2)
    assert m["curve"][-1]["tokens"] == 6000 and m["curve"][-1]["loss"] == pytest.approx(3.5)
    lockstep = wan_report.summarize(fake_log(1000, [1.0, 1.0, 1.0]))
    assert "site_iterations" not in lockstep


def test_ceiling_adds_sites_and_ratios_use_it(tmp_path):
    sites = [wan_report.summarize(fake_log(500, [1.0, 1.0, 1.0], rss=r, losses=l))
             for r, l in ((100.0, (5, 4, 3)), (120.0, (5, 4, 5)))]
    ceiling = wan_report.combine_ceiling(sites)
    assert ceiling["tokens_per_s"] == pytest.approx(1000.0) and ceiling["loss"] == 4.0
    assert ceiling["peak_rss_mb"] == 120.0 and [p["tokens"] for p in ceiling["curve"]] == [1000, 2000, 3000]
    sync = wan_report.summarize(fake_log(1000, [4.0, 4.0, 4.0], bytes_per_interval=800.0, exposed=6.0))
    local = wan_report.summarize(fake_log(1000, [1.25, 1.25, 1.25], bytes_per_interval=8.0))
    scenario = {"sites": 2, "ranks_per_site": 1, "rate_mbit": 100.0, "delay_ms": 20.0,
                "straggler": {"ranks": "1", "factor": 2.0, "mode": "consistent"}}
    results = wan_report.build_results(scenario, ceiling, {"sync": sync, "local": local})
    rows = {r["algorithm"]: r for r in results["runs"]}
    assert rows["sync"]["ratio_to_ceiling"] == pytest.approx(0.25)
    assert rows["local"]["ratio_to_ceiling"] == pytest.approx(0.8)
    assert rows["local"]["bytes_vs_sync"] == pytest.approx(0.01)
    for row in results["runs"]:
        assert {"algorithm", "tokens_per_s", "ratio_to_ceiling", "inter_site_bytes_per_step",
                "exposed_comm_s_per_step", "loss", "peak_rss_mb"} <= set(row)
    paths = wan_report.write_all(results, str(tmp_path))
    assert {os.path.basename(p) for p in paths} == {"results.json", "results.md", "updates_per_s.png",
                                                    "tokens_per_s.png", "loss_vs_wall.png", "loss_vs_tokens.png"}
    table = open(tmp_path / "results.md").read()
    # the same batch everywhere: progress and work give the same ratios
    assert "| sync | 0.500 | **0.250** | 12 s (1.00) | 6 in 12 s | 250 | 0.250 | 500 |" in table
    assert "| local | 1.600 | **0.800** | 4 s (0.31) | 6 in 4 s | 800 | 0.800 | 500 |" in table
    assert "rank(s) 1 2x slower (consistent)" in table
    assert json.load(open(tmp_path / "results.json"))["scenario"]["rate_mbit"] == 100.0
    # loss at equal wall-clock: when the first algorithm finished (local, at 3.75 s), interpolated
    assert rows["local"]["equal_wall_s"] == pytest.approx(3.75) and rows["local"]["loss_at_equal_wall"] == 3.0
    assert rows["sync"]["loss_at_equal_wall"] is None  # sync's first point is at 4 s
    assert wan_report.loss_at(sync["curve"], "wall_s", 6.0) == pytest.approx(4.5)
    assert "loss at 4 s" in table


def test_unknown_algorithm_is_refused():
    done = subprocess.run([sys.executable, "tools/benchmarks/wan/wan_bench.py", "--algorithms", "sync,nope"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "'nope' is not registered" in done.stderr


@pytest.mark.slow
def test_tiny_benchmark_over_two_namespaces(tmp_path):
    try:
        caps = probe()
    except WanError as err:
        pytest.skip(f"network namespaces not permitted here: {err}")
    if not (caps.tun or caps.netem):
        pytest.skip("neither sch_netem nor /dev/net/tun: no link with delay can be built")
    try:
        from megatron_lsgd import _C  # noqa: F401
    except ImportError:
        pytest.skip("megatron_lsgd._C not built (pip install -e .): the bundled corpus needs it")
    before = set(list_namespaces())
    done = subprocess.run([sys.executable, "tools/benchmarks/wan/wan_bench.py", "--algorithms", "sync",
                           "--train-iters", "4", "--log-interval", "2", "--seq-length", "32", "--rate-mbit", "50",
                           "--delay-ms", "5", "--extra-args", "--num-layers 2 --hidden-size 64",
                           "--out-dir", str(tmp_path)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {r["algorithm"]: r for r in json.load(open(tmp_path / "results.json"))["runs"]}
    assert rows["ceiling"]["inter_site_bytes_per_step"] == 0 and rows["ceiling"]["ratio_to_ceiling"] == 1.0
    # sync moves the whole gradient each step: 2 (S-1)/S x 4 bytes x parameters, sent and received
    assert rows["sync"]["inter_site_bytes_per_step"] > 1e6 and rows["sync"]["exposed_comm_s_per_step"] > 0
    assert 0 < rows["sync"]["ratio_to_ceiling"] < 1
    assert set(list_namespaces()) == before


def test_time_to_sync_final_loss():
    curve = [{"wall_s": 10.0, "loss": 6.0}, {"wall_s": 20.0, "loss": 4.0}, {"wall_s": 30.0, "loss": 3.0}]
    assert wan_report.time_to_loss(curve, 5.0) == pytest.approx(15.0)  # halfway between 6 and 4
    assert wan_report.time_to_loss(curve, 7.0) == 10.0 and wan_report.time_to_loss(curve, 2.0) is None
    sync = wan_report.summarize(fake_log(1000, [4.0, 4.0, 4.0], losses=(5.0, 4.0, 3.0)))
    fast = wan_report.summarize(fake_log(1000, [1.0, 1.0, 1.0], losses=(4.0, 3.0, 2.5)))
    slow = wan_report.summarize(fake_log(1000, [1.0, 1.0, 1.0], losses=(6.0, 5.0, 4.0)))
    results = wan_report.build_results({"sites": 2, "ranks_per_site": 1, "rate_mbit": 100.0, "delay_ms": 20.0},
                                       sync, {"sync": sync, "fast": fast, "slow": slow})
    rows = {r["algorithm"]: r for r in results["runs"]}
    assert rows["fast"]["time_to_sync_loss_s"] == 2.0 and rows["fast"]["time_to_sync_loss_vs_sync"] == 2.0 / 12.0
    assert rows["sync"]["time_to_sync_loss_vs_sync"] == 1.0 and rows["slow"]["time_to_sync_loss_s"] is None
    table = wan_report.markdown_table(results)
    assert "| 2 s (0.17) |" in table and "not reached" in table


def test_one_algorithm_can_run_twice_under_labels():
    from tools.benchmarks.wan import wan_bench

    a = wan_bench.parse_args(["--algorithms", "diloco,dx=dilocox,dx4=dilocox", "--algo-args",
                              "dx4=--lsgd-compression int4"])
    assert a.algorithms == ["diloco", "dx", "dx4"]
    assert a.run_algorithm == {"diloco": "diloco", "dx": "dilocox", "dx4": "dilocox"}
    assert a.per_algo == {"dx4": ["--lsgd-compression", "int4"]}
    for bad in (["--algorithms", "x=nope"], ["--algorithms", "diloco,diloco"], ["--algorithms", "ceiling=sync"],
                ["--algorithms", "sync", "--algo-args", "dx=--lsgd-interval 3"]):
        with pytest.raises(SystemExit):
            wan_bench.parse_args(bad)


def test_headline_is_progress_when_an_algorithm_grows_its_batch(tmp_path):
    # acco-like: each update carries 8x the tokens and takes 8x as long (micro-batches added
    # while the link is busy): the same tokens/s as the ceiling, an eighth of its updates/s
    ceiling = wan_report.summarize(fake_log(1000, [1.0, 1.0, 1.0]))
    sync = wan_report.summarize(fake_log(1000, [4.0, 4.0, 4.0], losses=(5.0, 4.0, 3.0)))
    grown = wan_report.summarize(fake_log(8000, [8.0, 8.0, 8.0], losses=(4.0, 3.5, 2.0)))
    assert grown["updates_per_s"] == pytest.approx(0.25) and grown["tokens_per_s"] == pytest.approx(1000.0)
    assert grown["updates"] == 6 and grown["tokens_trained"] == 24000 and grown["tokens_per_update"] == 4000
    assert grown["run_wall_s"] == 24.0
    results = wan_report.build_results({"sites": 2, "ranks_per_site": 1, "rate_mbit": 100.0, "delay_ms": 20.0},
                                       ceiling, {"sync": sync, "grown": grown})
    rows = {r["algorithm"]: r for r in results["runs"]}
    assert rows["grown"]["ratio_to_ceiling"] == pytest.approx(1.0)  # the old field, kept: work
    assert rows["grown"]["updates_ratio_to_ceiling"] == pytest.approx(0.125)  # progress
    assert rows["sync"]["updates_ratio_to_ceiling"] == pytest.approx(0.25)
    # reaches sync's final loss (3.0) between its 2nd and 3rd points: 16 + 8 x (3.5-3)/(3.5-2)
    assert rows["grown"]["time_to_sync_loss_s"] == pytest.approx(16.0 + 8.0 / 3.0)
    table = wan_report.markdown_table(results)
    assert "| grown | 0.250 | **0.125** | 19 s (1.56) | 6 in 24 s | 1000 | 1.000 | 4000 |" in table
    assert "**1.000**" not in table.split("| grown |")[1]  # the work ratio is not the bold headline
    paths = wan_report.write_all(results, str(tmp_path))
    assert "updates/s: optimizer steps per second" in open(tmp_path / "results.md").read()
    assert os.path.join(str(tmp_path), "updates_per_s.png") in paths


def test_sites_that_step_alone_average_their_update_rates():
    fast = wan_report.summarize(fake_log(1000, [1.0, 1.0, 1.0]))
    slow = wan_report.summarize(fake_log(1000, [2.0, 2.0, 2.0]))
    ceiling = wan_report.combine_ceiling([fast, slow])
    # tokens add up (1000 + 500), updates do not (2 and 1 per second): each site moves its own model
    assert ceiling["tokens_per_s"] == pytest.approx(1500.0) and ceiling["updates_per_s"] == pytest.approx(1.5)
    assert ceiling["tokens_per_update"] == 1000 and ceiling["run_wall_s"] == 6.0
    edit = wan_report.summarize([dict(r, site=0) for r in fake_log(1000, [1.0, 1.0, 1.0])]
                                + [dict(r, site=1) for r in fake_log(1000, [2.0, 2.0])])
    assert edit["updates_per_s"] == pytest.approx((2.0 + 1.0) / 2) and edit["updates"] == 5
    assert edit["tokens_per_update"] == pytest.approx(5000 / 5)


def test_an_old_run_is_re_reported_from_its_logs(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    alone = fake_log(500, [1.0, 1.0, 1.0])
    for name, log in (("ceiling.site0", alone), ("ceiling.site1", alone),
                      ("sync", fake_log(1000, [4.0, 4.0, 4.0])), ("grown", fake_log(8000, [8.0, 8.0, 8.0]))):
        (logs / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    old = {"scenario": {"sites": 2, "ranks_per_site": 1, "rate_mbit": 100.0, "delay_ms": 20.0},
           "runs": [{"algorithm": "ceiling"}, {"algorithm": "sync"}, {"algorithm": "grown"}]}
    (tmp_path / "results.json").write_text(json.dumps(old))
    assert wan_report.main([str(tmp_path)]) == 0
    rows = {r["algorithm"]: r for r in json.load(open(tmp_path / "results.json"))["runs"]}
    assert list(rows) == ["ceiling", "sync", "grown"]
    assert rows["grown"]["updates_ratio_to_ceiling"] == pytest.approx(0.125)
    assert (tmp_path / "updates_per_s.png").exists()
    done = subprocess.run([sys.executable, "tools/benchmarks/wan/wan_report.py", str(tmp_path / "nothing")],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("error: ") and "Traceback" not in done.stderr


def test_a_run_reported_into_docs_keeps_its_data_under_results(tmp_path, monkeypatch):
    """An OUT_DIR in docs/ gets the table and the plots; results.json and logs/ are read from and
    written to the same path under results/ (measured data stays out of docs/)."""
    from tools.benchmarks import run_cache

    monkeypatch.setattr(run_cache, "DOCS", str(tmp_path / "docs"))
    monkeypatch.setattr(run_cache, "RESULTS", str(tmp_path / "results"))
    pages, data = tmp_path / "docs" / "benchmarks" / "x", tmp_path / "results" / "benchmarks" / "x"
    (data / "logs").mkdir(parents=True)
    for name, log in (("ceiling.site0", fake_log(500, [1.0, 1.0, 1.0])), ("ceiling.site1", fake_log(500, [1.0, 1.0, 1.0])),
                      ("sync", fake_log(1000, [4.0, 4.0, 4.0]))):
        (data / "logs" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    (data / "results.json").write_text(json.dumps({"scenario": {"sites": 2, "ranks_per_site": 1, "rate_mbit": 100.0,
                                                                "delay_ms": 20.0},
                                                   "runs": [{"algorithm": "ceiling"}, {"algorithm": "sync"}]}))
    assert wan_report.main([str(pages)]) == 0
    assert sorted(os.listdir(pages)) == ["loss_vs_tokens.png", "loss_vs_wall.png", "results.md", "tokens_per_s.png",
                                         "updates_per_s.png"]
    assert sorted(os.listdir(data)) == ["logs", "results.json"]
    assert "ratio_to_ceiling" in json.load(open(data / "results.json"))["runs"][0]


def test_a_damaged_run_directory_is_one_error_line(tmp_path, capsys):
    """results.json of another shape, a log line cut short or not an object: one `error:` line
    naming the file (and the line), exit 2."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (tmp_path / "results.json").write_text("[1, 2]")
    assert wan_report.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "results.json" in err and "list" in err
    (tmp_path / "results.json").write_text(json.dumps({"scenario": {"sites": 1}, "runs": []}))
    for bad, says in (('{"site": 0, "iter', "line 2 is damaged"), ("[3]", "line 2 holds a JSON list")):
        (logs / "ceiling.site0.jsonl").write_text(json.dumps(fake_log(500, [1.0])[0]) + "\n" + bad + "\n")
        assert wan_report.main([str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.count("error:") == 1 and "ceiling.site0.jsonl" in err and says in err, err
    (tmp_path / "results.json").write_text(json.dumps({"scenario": [], "runs": []}))
    assert wan_report.main([str(tmp_path)]) == 2  # a foreign layout, not a traceback
    assert capsys.readouterr().err.count("error:") == 1
