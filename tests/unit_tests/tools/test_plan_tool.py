"""tools/plan.py: the job's parsing, the memory model, the quality evidence, bad input, and
(slow) the agreement of its pilots with the leaderboard's."""

import glob
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

from megatron_lsgd.training.scenario import load_scenario  # noqa: E402
from tools.planning.evidence import algorithm_of, far_beyond, read_evidence  # noqa: E402
from tools.planning.job import Job, Model, job_from_toml  # noqa: E402
from tools.planning.memory import memory_per_gpu  # noqa: E402

SCENARIOS = os.path.join(ROOT, "tools", "benchmarks", "scenarios")


def test_a_leaderboard_scenario_is_a_job_and_its_scenario_charges_the_same(tmp_path):
    path = os.path.join(SCENARIOS, "3site-1gbit-straggler.toml")
    job = job_from_toml(path)
    assert job.sites == 3 and job.params == 1e9 and job.tokens_per_step == 3 * 65536
    assert job.gpus_per_site == [8, 8, 8] and job.site_factors == [1.0, 1.0, 2.0]
    assert job.total_tokens == 20e9 and job.notes  # assumed, and said so
    written = tmp_path / "job.toml"
    written.write_text(job.scenario_toml())
    mine, board = load_scenario(str(written)), load_scenario(path)
    for key in ("sites", "microbatch_seconds", "optimizer_step_seconds", "intra_site_gbit", "site_factors",
                "rate_mbit", "latency_ms"):
        assert getattr(mine, key) == pytest.approx(getattr(board, key)), key
    assert mine.bytes_scale_for(1_491_584) == pytest.approx(board.bytes_scale_for(1_491_584))


def test_job_file_with_model_shape_and_job_table(tmp_path):
    f = tmp_path / "job.toml"
    f.write_text('sites = 2\n[compute]\ngpus_per_replica = 8\nsustained_tflops = 400\n[link]\nrate_mbit = [1000, 500]\n'
                 'latency_ms = 30\n[model]\nnum_layers = 2\nhidden_size = 64\nnum_attention_heads = 4\n'
                 'vocab_size = 100\nswiglu = false\nuntie_embeddings = false\n'
                 '[job]\ntokens_per_step = 8192\ntotal_tokens = 1e6\nseq_length = 512\ntensor_parallel = 2\n')
    job = job_from_toml(str(f))
    # by hand: per layer 4 x 64^2 attention + 2 x 64 x 256 MLP + 2 x 64 norms = 49280; final norm 64;
    # tied embedding 100 x 64
    assert job.params == 2 * 49280 + 64 + 6400
    assert job.rate_mbit == [1000.0, 500.0] and job.latency_ms == [30.0, 30.0]
    assert job.tensor_parallel == [2, 2] and job.dp_intra() == 4 and job.steps == 123  # ceil(1e6 / 8192)
    assert not job.mixed_layouts and job.layout_factors() == [1.0, 1.0]


def test_llama_shape_counts_like_llama_7b():
    llama = Model(num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=11008, vocab_size=32000)
    assert llama.parameter_count() == pytest.approx(6.738e9, rel=1e-3)  # Llama-2-7B's published count


def test_memory_per_component_by_hand():
    # 8e9 params, TP 2, PP 2, DP_intra 4: local 2e9, shard 5e8
    m = memory_per_gpu(8e9, tp=2, pp=2, dp_intra=4, algorithm="dilocox", compression="int4", outer_momentum=True,
                       seq=1024, micro_batch=2, hidden=1024, heads=16, layers=8, recompute="selective",
                       microbatches=8)
    assert m.weights == 4e9 and m.gradients == 8e9 and m.optimizer == 6e9
    assert m.outer_state == 4e9 and m.compressor == 2e9 and m.algorithm_buffers == 0
    # 34 x s b h / TP per layer, 8 / 2 layers a stage, min(PP, 8) = 2 micro-batches in flight
    assert m.activations == 34 * 1024 * 2 * 1024 / 2 * 4 * 2
    full = memory_per_gpu(8e9, 2, 2, 4, "acco", "none", False, 1024, 2, 1024, 16, 8, "full", 8)
    assert full.outer_state == 0 and full.compressor == 0
    assert full.algorithm_buffers == 4 * 2e9 + 4 * 5e8  # second gradient buffer + the worker's fp32 copy
    assert full.activations == 2 * 1024 * 2 * 1024 * 4 * 2
    none = memory_per_gpu(8e9, 2, 2, 4, "sync", "none", False, 1024, 2, 1024, 16, 8, "none", 1)
    assert none.activations == 1024 * 2 * 1024 * (34 + 5 * 16 * 1024 / 1024) / 2 * 4 * 1
    assert none.outer_state == 0 and none.total == 4e9 + 8e9 + 6e9 + none.activations


def _quality_json(path, sync_curve, curves, argv_extra=()):
    argv = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
            "--global-batch-size", "16", "--train-iters", "1000", "--swiglu", *argv_extra]
    data = {"label": "test", "argv": argv, "sync": {"sync": {"1": {"train": sync_curve}, "2": {"train": sync_curve}}},
            "results": {label: {"1": {"train": c}, "2": {"train": c}} for label, c in curves.items()}}
    path.write_text(json.dumps(data))
    return str(path)


def test_evidence_multiplier_provenance_and_no_extrapolation(tmp_path):
    sync = [10.0 - 0.1 * i for i in range(20)]
    fast = [10.0 - 0.2 * i for i in range(10)] + [8.0] * 10
    slow = [10.0 - 0.05 * i for i in range(20)]  # never does
    e = read_evidence(_quality_json(tmp_path / "q.json", sync, {"diloco-H100": fast, "dpu": slow}))
    assert e.tokens == 1000 * 16 * 128 and e.seeds == ["1", "2"]
    assert e.params == Model(num_layers=4, hidden_size=128, num_attention_heads=4, vocab_size=8192,
                             untie_embeddings=False).parameter_count()
    # sync ends at 8.3 (mean of its last 5); the running mean of 5 first gets there at point 12 of 20
    assert e.figures["diloco"].multiplier == pytest.approx(0.6)
    assert e.figures["dpu"].multiplier is None and e.figures["dpu"].final_gap > 0
    assert far_beyond(e, e.params * 100, e.tokens_per_param)  # 100x the model: said so
    assert not far_beyond(e, e.params * 2, e.tokens_per_param * 2)
    assert algorithm_of("streaming-default") == "streaming-diloco" and algorithm_of("a-edit-tau50") == "a-edit"


def test_every_committed_quality_page_loads():
    pages = glob.glob(os.path.join(ROOT, "results", "quality*.json"))
    assert pages
    for page in pages:
        e = read_evidence(page)
        assert 1e5 < e.params < 1e8 and e.tokens > 0 and e.figures  # the ladder's rung S: 0.26M


@pytest.mark.parametrize("argv, names", [
    (["--sites", "2", "--rate-mbit", "100", "--tokens-per-step", "8192", "--sustained-tflops", "400"], "--params"),
    (["--sites", "1", "--rate-mbit", "100", "--tokens-per-step", "8192", "--params", "1e9",
      "--sustained-tflops", "400"], "sites"),
    (["--sites", "2", "--rate-mbit", "100,1,3", "--tokens-per-step", "8192", "--params", "1e9",
      "--sustained-tflops", "400"], "--rate-mbit"),
    (["--sites", "2", "--rate-mbit", "100", "--tokens-per-step", "8192", "--params", "1e9"], "--sustained-tflops"),
    (["--sites", "2", "--rate-mbit", "0", "--tokens-per-step", "8192", "--params", "1e9",
      "--sustained-tflops", "400"], "--rate-mbit"),
    (["--sites", "2", "--rate-mbit", "100", "--tokens-per-step", "8192", "--params", "1e9",
      "--sustained-tflops", "400", "--gpus-per-site", "8", "--tensor-parallel", "3"], "--tensor-parallel"),
    (["--sites", "2", "--rate-mbit", "x", "--tokens-per-step", "8192"], "--rate-mbit"),
    (["--job", "/no/such/job.toml"], "--job /no/such/job.toml"),
    (["--sites", "2", "--rate-mbit", "100", "--tokens-per-step", "8192", "--params", "1e9",
      "--sustained-tflops", "400", "--algorithms", "sync,nope"], "--algorithms"),
    (["--sites", "2", "--grid", "--grid-compressions", "int4,lowrank-int4"], "the matrices' shapes"),
    (["--sites", "2", "--grid-compressions", "int8"], "only with --grid"),
])
def test_bad_input_is_one_error_line_naming_the_flag(argv, names, capsys):
    import plan

    with pytest.raises(SystemExit) as exit_:
        plan.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and names in err[0], err


def test_bad_job_file_names_the_key(tmp_path, capsys):
    import plan

    f = tmp_path / "job.toml"
    f.write_text("sites = 2\n[compute]\nsustained_tflops = 400\n[link]\nrate_mbit = 100\n[model]\nparms = 1e9\n")
    with pytest.raises(SystemExit) as exit_:
        plan.main(["--job", str(f)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "parms" in err and "[model]" in err


@pytest.mark.slow
def test_pilot_pace_equals_the_boards_pilot_and_a_failed_pilot_is_left_out_alone():
    """The planner's pilots, run in one set of ranks, give the board's pace within 2%: sync
    (from its 300-step cell), dilocox (which overlaps its exchange with the next round: one
    round's pilot was 22% slow) and acco (adaptive accumulation: 10 steps were 3.9% slow). A
    pilot that fails (a bad flag) is tried again, then reported and left out; the pilots after
    it still run and keep their paces."""
    from tools.planning.board_check import board_pace
    from tools.planning.pilots import Pilot, run_pilots

    name = "2x8gpu-1gbit-1b"
    path = os.path.join(SCENARIOS, f"{name}.toml")
    scenario = load_scenario(path)
    lines = []
    # the bad one second: the pilots after it run on after it stops the batch twice
    pilots = [Pilot("sync"), Pilot("diloco", ["--lsgd-interval", "-1"], 7), Pilot("dilocox"), Pilot("acco")]
    paces = run_pilots([], path, scenario, progress=lines.append, pilots=pilots)
    assert paces["dilocox"].steps == 300 and paces["acco"].steps == 50
    for label in ("sync", "dilocox", "acco"):
        assert paces[label].seconds_per_step == pytest.approx(board_pace(name, label, scenario.sites), rel=0.02)
    assert paces["diloco H=7"] is None
    assert any("diloco H=7 pilot failed twice" in line for line in lines)
    assert "--seq-length" not in paces["dilocox"].settings  # the pilot's short sequence is not a setting


@pytest.mark.slow
def test_a_grid_points_pace_follows_its_setting():
    """On 2x8gpu-1gbit-1b (1B over 1 Gbit/s, one round's pilots): sync at int4 moves int4's bytes
    (half a byte and a 4-byte scale per 64 values, all-gathered between two sites: 0.5625 / 4 of
    fp32's ring) and waits that much less; streaming-diloco's exchanges are the whole model at 1
    fragment (16 bytes per parameter between two sites) and smaller each at 2 and 4, and its step
    differs; dilocox uncompressed sends fp32, as diloco does."""
    from tools.planning.pilots import Pilot, grid, run_pilots

    path = os.path.join(SCENARIOS, "2x8gpu-1gbit-1b.toml")
    scenario = load_scenario(path)
    pilots = [p for p in grid(["sync", "streaming-diloco", "dilocox"], scenario) if p.interval is None]
    paces = run_pilots([], path, scenario, 10, progress=None, pilots=pilots + [Pilot("diloco")])
    sync, int4 = paces["sync"], paces["sync compression=int4"]
    ratio = 0.5625 / 4
    assert int4.cross_site_bytes_per_step == pytest.approx(ratio * sync.cross_site_bytes_per_step, rel=0.01)
    assert int4.exposed_seconds_per_step == pytest.approx(ratio * sync.exposed_seconds_per_step, rel=0.02)
    assert "--lsgd-compression" not in sync.settings

    def per_exchange(label):
        pace = paces[label]
        return pace.cross_site_bytes_per_step * pace.steps / pace.stats["fragment syncs"]

    whole, two, four = (per_exchange(f"streaming-diloco{k}") for k in (" fragments=1", "", " fragments=4"))
    assert whole == pytest.approx(16 * 1e9, rel=0.01) and whole > 1.1 * two and two > 1.1 * four
    # one exchange per round instead of K, each with tau = 5 steps to hide in: the step cannot stay the same
    one, recommended = (paces[f"streaming-diloco{k}"].seconds_per_step for k in (" fragments=1", ""))
    assert abs(one - recommended) > 0.01 * recommended
    assert paces["dilocox compression=none"].cross_site_bytes_per_step == \
        pytest.approx(paces["diloco"].cross_site_bytes_per_step, rel=0.01)
    assert paces["dilocox compression=none"].cross_site_bytes_per_step > 5 * paces["dilocox"].cross_site_bytes_per_step


@pytest.mark.slow
def test_the_pilots_speed_flags_keep_the_boards_pace(monkeypatch):
    """The clock charges a micro-batch at the scenario's cost whatever its length and whatever
    the optimizer's kernel computes, and with rotary positions the parameters do not depend on
    the length: the pilots' short sequence and fused AdamW (PILOT_SPEED) give the paces of the
    board's (SEQ, foreach) bit for bit, while training less. acco's adaptive accumulation and the
    streaming family's overlapped fragments are the most timing-driven."""
    from tools.benchmarks.board.leaderboard_setup import SEQ
    from tools.planning import pilots

    path = os.path.join(SCENARIOS, "4site-10gbit-8b.toml")
    scenario = load_scenario(path)
    runs = [pilots.Pilot("streaming-diloco", pilots.interval_flags("streaming-diloco", scenario, 16), 16),
            pilots.Pilot("acco")]
    assert pilots.PILOT_SEQ < SEQ and "fused" in pilots.PILOT_SPEED
    short = pilots.run_pilots([], path, scenario, 10, progress=None, pilots=runs)
    monkeypatch.setattr(pilots, "PILOT_SPEED", ())  # the board's cell: its sequence, the default kernel
    board = pilots.run_pilots([], path, scenario, 10, progress=None, pilots=runs)
    for label in short:
        for key in ("seconds_per_step", "exposed_seconds_per_step", "cross_site_bytes_per_step"):
            assert getattr(short[label], key) == getattr(board[label], key), (label, key)


def test_the_grid_halves_and_doubles_h_in_whole_fragments():
    from tools.benchmarks.recipes import recommended_interval
    from tools.planning.pilots import grid, pilot_steps

    path = os.path.join(SCENARIOS, "3site-1gbit-straggler.toml")
    scenario = load_scenario(path)
    h = recommended_interval(scenario)
    pilots = [p for p in grid(["sync", "streaming-diloco", "a-edit"], scenario) if not p.differs]  # H's points
    assert [p.label for p in pilots][:1] == ["sync"] and len(pilots) == 1 + 3 + 3
    streaming = [p for p in pilots if p.algorithm == "streaming-diloco" and p.interval]
    assert sorted(p.interval for p in streaming) == sorted({-(-round(h * f) // 2) * 2 for f in (0.5, 2.0)})
    for p in streaming:
        assert p.extra[p.extra.index("--lsgd-fragment-sync-delay") + 1] == str(min(5, max(1, p.interval // 8)))
        assert pilot_steps(p.algorithm, scenario, None, p.interval) % p.interval == 0
    assert all("--lsgd-aedit-interval-seconds" in p.extra for p in pilots if p.algorithm == "a-edit" and p.interval)


def test_the_grid_moves_one_setting_at_a_time_labelled_by_it():
    """Fragments for the streaming family (4: a stand-in of 4 layers, a fragment needing a layer;
    not a setting), int4 for what sends uncompressed, none for dilocox; dreamddp takes no
    compressor; the pasted flags carry each setting once, the stand-in's layers not at all."""
    from tools.planning.pilots import _argv, grid, pace_from_cell

    path = os.path.join(SCENARIOS, "2x8gpu-1gbit-1b.toml")
    scenario = load_scenario(path)
    pilots = {p.label: p for p in grid(["sync", "dilocox", "streaming-diloco", "cocodc", "dreamddp"], scenario)}
    assert [label for label in pilots if label.startswith("streaming-diloco")] == [
        "streaming-diloco", "streaming-diloco H=50", "streaming-diloco H=200", "streaming-diloco fragments=1",
        "streaming-diloco fragments=4", "streaming-diloco compression=int4"]
    assert "cocodc fragments=1" in pilots and "cocodc fragments=4" in pilots
    assert "sync compression=int4" in pilots and "dilocox compression=none" in pilots
    assert not [label for label in pilots if label.startswith("dreamddp ") and "H=" not in label]
    four = pilots["streaming-diloco fragments=4"]
    assert four.stand_in == ["--num-layers", "4"] and pilots["streaming-diloco fragments=1"].stand_in == []
    argv = _argv(four, path, scenario, 300)
    assert argv[len(argv) - 1 - argv[::-1].index("--num-layers") + 1] == "4"  # the last one counts
    cell = {"seconds": 30.0, "iterations": 300, "traffic": {"bytes": 8.0e9, "sync_bytes": 16 * 300 * 1.9e6}}
    for label, flag, value in (("streaming-diloco fragments=4", "--lsgd-fragments", "4"),
                               ("dilocox compression=none", "--lsgd-compression", "none"),
                               ("sync compression=int4", "--lsgd-compression", "int4")):
        settings = pace_from_cell(pilots[label], scenario, 300, cell).settings
        assert settings.count(flag) == 1 and settings[settings.index(flag) + 1] == value
        assert "--num-layers" not in settings


def test_a_grid_point_the_algorithm_would_refuse_is_not_run():
    """K must cut H into slots longer than tau (H = 78: not 4); sites of different sizes take
    only the compressors the class weights by tokens (sync: none)."""
    from tools.benchmarks.recipes import recommended_interval
    from tools.planning.pilots import compression_points, fragment_points

    scenario = load_scenario(os.path.join(SCENARIOS, "emulated-straggler2x.toml"))
    assert recommended_interval(scenario) == 78
    assert [p.label for p in fragment_points("cocodc", scenario)] == ["cocodc fragments=1"]
    unequal = load_scenario(os.path.join(SCENARIOS, "2site-16-8gpu-1gbit-1b.toml"))
    assert compression_points("sync", unequal) == [] and compression_points("sync", scenario)
    # sites of different sizes: only what the class weights by tokens (diloco, dilocox: int8, int4 and none)
    assert [p.label for p in compression_points("diloco", unequal)] == ["diloco compression=int4"]
    assert [p.label for p in compression_points("dilocox", unequal)] == ["dilocox compression=none"]
    assert fragment_points("diloco", scenario) == []
    # --grid-compressions: each one but the recommended; uncompressed where the recommended compresses
    kinds = ("int8", "int4", "topk-2bit")
    assert [p.label for p in compression_points("diloco", scenario, kinds)] == [
        "diloco compression=int8", "diloco compression=int4", "diloco compression=topk-2bit"]
    assert [p.label for p in compression_points("dilocox", scenario, kinds)] == [
        "dilocox compression=none", "dilocox compression=int8", "dilocox compression=topk-2bit"]
    assert [p.extra for p in compression_points("diloco", unequal, kinds)] == [
        ["--lsgd-compression", "int8"], ["--lsgd-compression", "int4"]]
    assert compression_points("sync", unequal, kinds) == []


def test_a_stand_in_of_other_layers_charges_bytes_scaled_by_its_own_parameters():
    """The board's stand-in is scaled by the board's count; a 4-layer one by its own, read from
    what per-step sync would have moved (16 (S - 1) bytes per parameter per step)."""
    from tools.planning.pilots import TRAINED_PARAMS_GUESS, Pilot, pace_from_cell, trained_params

    scenario = load_scenario(os.path.join(SCENARIOS, "3site-1gbit-straggler.toml"))
    cell = {"seconds": 30.0, "iterations": 100, "traffic": {"bytes": 3.0e9, "sync_bytes": 16 * 2 * 100 * 1.9e6}}
    assert trained_params(cell, 3) == pytest.approx(1.9e6)
    standard = pace_from_cell(Pilot("streaming-diloco"), scenario, 100, cell)
    four = pace_from_cell(Pilot("streaming-diloco", ["--lsgd-fragments", "4"], stand_in=["--num-layers", "4"]),
                          scenario, 100, cell)
    assert standard.cross_site_bytes_per_step == pytest.approx(3.0e7 * scenario.bytes_scale_for(TRAINED_PARAMS_GUESS))
    assert four.cross_site_bytes_per_step == pytest.approx(3.0e7 * scenario.bytes_scale_for(1.9e6))


def test_a_grid_rows_memory_and_quality_follow_its_setting():
    """Ranked first, a compressed row shows its own memory; an H row whose memory is the
    recommended row's shows under the recommended label, once. Compressed sync is not the
    reference: its multiplier is unmeasured (a lower bound), not 1."""
    import plan

    rows = [{"algorithm": "diloco", "label": "diloco compression=int4", "memory_gib": {"compressor": 0.5}},
            {"algorithm": "diloco", "label": "diloco H=200", "memory_gib": {"compressor": 0.0}},
            {"algorithm": "diloco", "label": "diloco", "memory_gib": {"compressor": 0.0}},
            {"algorithm": "diloco", "label": "diloco H=50", "memory_gib": {"compressor": 0.0}}]
    assert [r["label"] for r in plan._differing_rows(rows, "memory_gib")] == ["diloco compression=int4", "diloco"]
    assert plan.quality(None, "sync", [], "int4")["multiplier"] is None
    assert plan.quality(None, "sync", [])["multiplier"] == 1.0


def test_a_pilots_port_is_chosen_by_rank_0_when_it_starts_and_read_by_the_others(tmp_path, monkeypatch):
    """Ports chosen up front for a grid's dozens of pilots were taken by other jobs minutes
    later and stopped the batch: rank 0 names each pilot's port as it starts."""
    from tools.planning import pilots

    monkeypatch.setattr(pilots, "PORT_WAIT_SECONDS", 0.1)
    with pytest.raises(RuntimeError, match="named no port"):
        pilots._port_for(1, str(tmp_path))  # rank 0 has not started this pilot
    port = pilots._port_for(0, str(tmp_path))
    assert pilots._port_for(1, str(tmp_path)) == port > 0


def test_a_step_is_a_global_batch_of_the_jobs_tokens_not_an_update(monkeypatch):
    """acco/dpu's adaptive accumulation puts several global batches in one update: the pace is
    per global batch consumed (a pilot of 10 updates that read 80 batches: seconds / 80)."""
    from tools.benchmarks.board import leaderboard
    from tools.planning import pilots

    path = os.path.join(SCENARIOS, "3site-1gbit-straggler.toml")
    scenario = load_scenario(path)
    gbs = pilots.MICRO_BATCH * scenario.sites
    cell = {"seconds": 40.0, "samples": 80 * gbs, "traffic": {"bytes": 800.0}, "comm": {"exposed_seconds": 8.0}}
    monkeypatch.setattr(leaderboard, "run_cell", lambda argv, sites: cell)
    pace = pilots.run_pilot("acco", path, scenario, 10)
    assert pace.seconds_per_step == pytest.approx(0.5) and pace.exposed_seconds_per_step == pytest.approx(0.1)
    assert pace.cross_site_bytes_per_step == pytest.approx(10.0 * scenario.bytes_scale_for(
        pilots.TRAINED_PARAMS_GUESS))


def test_a_page_that_states_its_model_size_is_taken_at_its_word(tmp_path):
    """The ladder's pages state their parameters (another tokenizer than the one argv's estimate
    assumes): the evidence uses the stated count."""
    argv = ["--num-layers", "2", "--hidden-size", "48", "--num-attention-heads", "4", "--seq-length", "256",
            "--global-batch-size", "16", "--train-iters", "1262", "--swiglu"]
    page = {"argv": argv, "sync": {"sync": {"1": {"train": [5.0, 4.0]}}},
            "results": {"diloco-H30-avg": {"1": {"train": [5.1, 4.2]}}}}
    path = tmp_path / "quality-ladder-S.json"
    path.write_text(json.dumps(page))
    estimated = read_evidence(str(path)).params
    path.write_text(json.dumps({**page, "model_parameters": {"total": 258288, "non_embedding": 55536}}))
    e = read_evidence(str(path))
    assert e.params == 258288 != estimated and e.tokens_per_param == pytest.approx(1262 * 16 * 256 / 258288)


def test_the_evidence_nearest_a_job_is_first_its_tokens_per_parameter_then_its_size():
    """A job at 20 tokens per parameter reads the ladder's 20-token page, not a 7x larger toy
    at 3 tokens per parameter (which a size-first distance chose); at 3 it reads the toy."""
    from tools.planning.evidence import Evidence, Figure, nearest

    figure = {"diloco": Figure(point="diloco", algorithm="diloco", multiplier=None, final_gap=0.05, seeds=["1"])}
    toy = Evidence("toy.json", params=1.8e6, tokens=6e6, seeds=["1"], figures=figure)
    ladder = Evidence("ladder.json", params=0.26e6, tokens=5.2e6, seeds=["1"], figures=figure)
    larger_ladder = Evidence("ladder-M.json", params=0.85e6, tokens=17e6, seeds=["1"], figures=figure)
    assert nearest([toy, ladder], "diloco", 1e9, 20).path == "ladder.json"
    assert nearest([toy, ladder, larger_ladder], "diloco", 1e9, 20).path == "ladder-M.json"
    assert nearest([toy, ladder], "diloco", 1e9, 3).path == "toy.json"


def test_a_grid_points_flags_replace_the_recommended_ones_each_once():
    from tools.planning.pilots import merged

    recommended = ["--lsgd-interval", "100", "--lsgd-fragments", "2", "--lsgd-fragment-sync-delay", "5"]
    assert merged(recommended, ["--lsgd-interval", "50", "--lsgd-fragment-sync-delay", "6"]) == \
        ["--lsgd-interval", "50", "--lsgd-fragments", "2", "--lsgd-fragment-sync-delay", "6"]
    assert merged(["--lsgd-interval", "100"], ["--lsgd-compression", "int4"]) == \
        ["--lsgd-interval", "100", "--lsgd-compression", "int4"]


def test_sites_of_different_sizes_are_planned_for_the_algorithms_that_take_them(tmp_path):
    """16 + 8 GPUs: each site's share follows its size, so its compute per step is the
    job's tokens over all 24 GPUs (the scenario charges what 12 + 12 would); the memory is
    the 8-GPU site's (larger shards); edit refuses such sites and is listed with its reason;
    the pasted flags carry the sizes."""
    import plan

    def job(gpus):
        return plan.job_from_args(plan.parser().parse_args(
            ["--sites", "2", "--gpus-per-site", gpus, "--sustained-tflops", "400", "--rate-mbit", "1000",
             "--params", "1e9", "--tokens-per-step", "196608", "--total-tokens", "20e9"]))

    unequal, even = job("16,8"), job("12")
    for j, name in ((unequal, "u.toml"), (even, "e.toml")):
        (tmp_path / name).write_text(j.scenario_toml())
    u, e = load_scenario(str(tmp_path / "u.toml")), load_scenario(str(tmp_path / "e.toml"))
    assert u.microbatch_seconds == pytest.approx(e.microbatch_seconds)
    assert u.microbatch_seconds == pytest.approx(6 * 1e9 * 196608 / (24 * 400e12))
    assert u.optimizer_step_seconds == pytest.approx(16 * 1e9 / 8 / 3000e9)  # the 8-GPU site's
    assert unequal.smallest_site == 1 and unequal.microbatches() == 196608 // 4096 // 24
    refused = plan.refusals(unequal, ["sync", "diloco", "dilocox", "edit"])
    assert list(refused) == ["edit"] and "dp_inter group" in refused["edit"]
    assert plan.refusals(even, ["edit"]) == {}
    from tools.planning.pilots import Pace
    pace = Pace("diloco", ["--lsgd-interval", "100"], 300, 1.0, 0.1, 1.0, {})
    assert "--site-data-parallel-sizes 16,8" in plan.pretrain_flags(unequal, pace)
    assert "--site-data-parallel-sizes" not in plan.pretrain_flags(even, pace)


def test_sites_of_different_layouts_are_planned_for_the_algorithms_that_take_them(tmp_path):
    """16 GPUs at TP 8 beside 8 GPUs at TP 4: 2 replicas each, so each replica computes a quarter
    of a step, on 8 GPUs at site 0 and on 4 at site 1, which takes twice as long: site factors
    24 / (4 x 8) = 0.75 and 24 / (4 x 4) = 1.5 of the scenario's compute (its tokens over all 24
    GPUs). Only what exchanges in the layout-free form is planned (sync and edit are listed with
    their reasons), without a compressor (dilocox's recommended int4 is refused with such sites,
    also in the grid); the memory is the site's that needs the most; the pasted flags carry the
    layouts and no --site-data-parallel-sizes (the replicas are equal in number)."""
    import plan
    from tools.planning.pilots import Pace, base_pilot, grid

    def job(tp, gpus="16,8", pp="1"):
        return plan.job_from_args(plan.parser().parse_args(
            ["--sites", "2", "--gpus-per-site", gpus, "--tensor-parallel", tp, "--pipeline-parallel", pp,
             "--sustained-tflops", "400", "--rate-mbit", "1000", "--params", "1e9", "--num-layers", "16",
             "--hidden-size", "2048", "--tokens-per-step", "65536", "--total-tokens", "20e9", "--seq-length", "4096"]))

    mixed, plain = job("8,4"), job("4", gpus="8")
    assert mixed.mixed_layouts and not mixed.unequal and [mixed.dp_intra(s) for s in (0, 1)] == [2, 2]
    assert mixed.layout_factors() == [0.75, 1.5] and plain.layout_factors() == [1.0, 1.0]
    (tmp_path / "m.toml").write_text(mixed.scenario_toml())
    scenario = load_scenario(str(tmp_path / "m.toml"))
    assert scenario.site_factors == [0.75, 1.5]
    assert scenario.microbatch_seconds == pytest.approx(6 * mixed.params * 65536 / (24 * 400e12))
    refused = plan.refusals(mixed, ["sync", "diloco", "dilocox", "streaming-diloco", "edit"])
    assert list(refused) == ["sync", "edit"] and plan.refusals(plain, ["sync", "edit"]) == {}
    assert base_pilot("dilocox", scenario, uncompressed=True).label == "dilocox compression=none"
    assert base_pilot("dilocox", scenario).label == "dilocox"
    labels = [p.label for p in grid(["dilocox", "streaming-diloco"], scenario, uncompressed=True)]
    assert labels and all("compression=int4" not in label for label in labels)
    assert all("compression=none" in label for label in labels if label.startswith("dilocox"))
    assert all("--lsgd-compression" not in p.extra or p.extra[p.extra.index("--lsgd-compression") + 1] == "none"
               for p in grid(["dilocox"], scenario, uncompressed=True))
    # site 1 (TP 4) holds twice the parameters per GPU of site 0 (TP 8)
    site1 = plan.memory_per_gpu(mixed.params, 4, 1, 2, "diloco", "none", False, 4096, 1, 2048, 16, 16, "selective",
                                mixed.microbatches())
    assert plan.memory_for(mixed, "diloco", "none", mixed.microbatches()).total == site1.total
    flags = plan.pretrain_flags(mixed, Pace("diloco", ["--lsgd-interval", "100"], 300, 1.0, 0.1, 1.0, {}))
    assert "--site-tensor-model-parallel-sizes 8,4 --site-pipeline-model-parallel-sizes 1,1" in flags
    assert "--tensor-model-parallel-size" not in flags and "--site-data-parallel-sizes" not in flags
    # a pipeline that does not divide the layers on one site is named
    with pytest.raises(ValueError, match="--num-layers 16 is not a multiple of --pipeline-parallel 3"):
        job("8,1", gpus="8,3", pp="1,3")
    with pytest.raises(ValueError, match="--tensor-parallel has 3 values for 2 sites"):
        job("8,4,2")


def test_a_site_that_does_not_hold_whole_model_replicas_is_named():
    import plan

    with pytest.raises(ValueError, match="--gpus-per-site 6 is not a multiple"):
        plan.job_from_args(plan.parser().parse_args(
            ["--sites", "2", "--gpus-per-site", "16,6", "--tensor-parallel", "4", "--sustained-tflops", "400",
             "--rate-mbit", "1000", "--params", "1e9", "--tokens-per-step", "131072"]))


def test_a_step_that_does_not_divide_into_the_replicas_is_named_with_the_nearest_that_do(capsys):
    """32 sequences over 16 + 8 replicas: pretrain_gpt.py would refuse the global batch, so the
    planner says so first, with multiples of one micro-batch per replica (24 sequences)."""
    import plan

    with pytest.raises(SystemExit) as exit_:
        plan.main(["--sites", "2", "--gpus-per-site", "16,8", "--sustained-tflops", "400", "--rate-mbit", "1000",
                   "--params", "1e9", "--tokens-per-step", "131072"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "--tokens-per-step 131072" in err and "24 data-parallel replicas" in err
    assert "98304" in err and "196608" in err and len(err.splitlines()) == 1


def test_lower_bounds_say_what_loss_each_gave_up():
    """Where no measured multiplier exists, the ranking orders rows by the time for the tokens
    alone (a lower bound each), which would put a row 13% behind sync's loss above one 3%
    behind without a word: the table then lists the loss each ended at, best first."""
    import plan

    def row(label, seconds, gap):
        return {"algorithm": label, "label": label, "seconds_per_step": 1.0, "exposed_comm_seconds_per_step": 0.0,
                "cross_site_bytes_per_step": 0.0, "cross_site_bytes_per_run": 0.0, "memory_total_gib": 1.0,
                "memory_gib": {"weights": 1.0}, "train_seconds": seconds, "seconds_to_sync_loss": seconds,
                "seconds_to_sync_loss_is_lower_bound": True, "warnings": [], "pretrain_gpt_flags": "",
                "quality": {"multiplier": None, "final_gap": gap, "source": "q.json", "far": []}}

    job = {"sites": 2, "gpus_per_site": [8, 8], "rate_mbit": [1000.0] * 2, "latency_ms": [30.0] * 2,
           "site_factors": [1.0] * 2, "params": 1e9, "tokens_per_step": 1e5, "total_tokens": 2e10, "steps": 1,
           "tensor_parallel": [1, 1], "pipeline_parallel": [1, 1], "recompute": "selective", "notes": []}
    text = plan.table({"job": job, "timing": "t", "rows": [row("dilocox", 10.0, 0.136), row("diloco", 20.0, 0.03)]})
    assert "| 1 | dilocox |" in text and "TP 1 PP 1" in text
    assert "the loss each ended at, against sync's, where measured: diloco +3.0%, dilocox +13.6%" in text
    one = plan.table({"job": job, "timing": "t", "rows": [row("diloco", 20.0, 0.03)]})
    assert "the loss each ended at" not in one


def test_a_measured_time_ranks_above_every_lower_bound_and_each_bound_says_what_it_must_beat():
    """A bound ranked by its bound above a measured row would recommend a row that may never reach
    sync's loss (example 1 recommended dilocox, +13.6% at 1x) over one measured to: measured rows
    come first, and each bound row says below which multiplier it would beat the first."""
    import plan

    def row(label, train_seconds, multiplier=None, gap=None, at_least=None):
        q = {"multiplier": multiplier, "source": "q.json", "far": []}
        q.update({} if gap is None else {"final_gap": gap})
        q.update({} if at_least is None else {"at_least": at_least})
        return {"algorithm": label, "label": label, "seconds_per_step": 1.0, "exposed_comm_seconds_per_step": 0.0,
                "cross_site_bytes_per_step": 0.0, "cross_site_bytes_per_run": 0.0, "memory_total_gib": 1.0,
                "memory_gib": {"weights": 1.0}, "train_seconds": train_seconds,
                "seconds_to_sync_loss": train_seconds * (multiplier or at_least or 1.0),
                "seconds_to_sync_loss_is_lower_bound": multiplier is None, "warnings": [],
                "pretrain_gpt_flags": f"--lsgd-algorithm {label}", "quality": q}

    rows = [row("sync", 1000.0, 1.0), row("dilocox", 10.0, gap=0.136), row("diloco", 20.0, 1.2),
            row("streaming-diloco", 18.0, gap=0.035, at_least=1.5), row("cocodc", 25.0, gap=0.04),
            row("edit", 5.0)]
    plan.rank(rows)
    assert [r["label"] for r in rows] == ["diloco", "sync", "edit", "dilocox", "cocodc", "streaming-diloco"]
    by = {r["label"]: r for r in rows}
    assert by["dilocox"]["beats_first_below"] == pytest.approx(2.4) and by["dilocox"]["beats_first"] is True
    assert by["cocodc"]["beats_first"] is False  # diloco's 24 s is under its 25 s x (more than 1)
    assert by["streaming-diloco"]["beats_first"] is False  # ties at 1.33x, measured to need more than 1.5x
    assert by["edit"]["beats_first"] is None and "beats_first" not in by["sync"]
    job = {"sites": 2, "gpus_per_site": [8, 8], "rate_mbit": [1000.0] * 2, "latency_ms": [30.0] * 2,
           "site_factors": [1.0] * 2, "params": 1e9, "tokens_per_step": 1e5, "total_tokens": 2e10, "steps": 1,
           "tensor_parallel": [1, 1], "pipeline_parallel": [1, 1], "recompute": "selective", "notes": []}
    text = plan.table({"job": job, "timing": "t", "rows": rows})
    lines = {line.split("|")[2].strip(): line for line in text.splitlines() if line.startswith("| ") and "|---" not in line}
    assert lines["dilocox"].endswith("| 2.4 |") and lines["edit"].endswith("| 4.8 (quality unmeasured) |")
    assert lines["streaming-diloco"].endswith("| no (needs > 1.5, ties at 1.33) |")
    assert lines["cocodc"].endswith("| no (needs > 1, ties at 0.96) |") and lines["diloco"].endswith("| 24 s |  |")
    assert "recommended (diloco)" in text and "rank after every measured one" in text


def test_budget_points_give_the_multiplier_or_a_measured_lower_bound(tmp_path):
    """A point that does not reach sync's loss takes the multiplier its runs on more tokens
    measure (sync's final validation loss reached between two budgets), or, where none reached
    it, the largest budget as a lower bound, which the table shows and the time multiplies."""
    import plan

    sync = [10.0 - 0.1 * i for i in range(20)]
    never = [10.0 - 0.05 * i for i in range(20)]
    runs = lambda valid, train=never: {s: {"train": train, "valid": [valid]} for s in ("1", "2")}  # noqa: E731
    # a longer run's curve reaches sync's loss within it: as a point of its own it would claim that
    # fraction of *its* tokens as the multiplier
    page = {"argv": ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length",
                     "128", "--global-batch-size", "16", "--train-iters", "1000", "--swiglu"],
            "sync": {"sync": {s: {"train": sync, "valid": [4.0]} for s in ("1", "2")}},
            "results": {"diloco-H30-avg": runs(4.1), "diloco-H30-avg-x1.25": runs(4.02),
                        "diloco-H30-avg-x1.5": runs(3.98, sync), "streaming-diloco-H30": runs(4.2),
                        "streaming-diloco-H30-x1.25": runs(4.1), "streaming-diloco-H30-x1.5": runs(4.05)},
            "budgets": {f"{b}-x{k:g}": {"base": b, "scale": k} for b in ("diloco-H30-avg", "streaming-diloco-H30")
                        for k in (1.25, 1.5)}}
    path = tmp_path / "quality-ladder-S.json"
    path.write_text(json.dumps(page))
    e = read_evidence(str(path))
    assert set(e.figures) == {"diloco", "streaming-diloco"}  # the budget points are not points of their own
    diloco, streaming = e.figures["diloco"], e.figures["streaming-diloco"]
    assert diloco.point == "diloco-H30-avg" and diloco.multiplier == pytest.approx((1.25 * 1.5) ** 0.5)
    assert "1.25x, 1.5x" in diloco.how
    assert streaming.multiplier is None and streaming.at_least == 1.5

    q = {"multiplier": None, "at_least": 1.5, "final_gap": 0.05, "source": "q.json", "far": [], "point": "p",
         "seeds": ["1"], "how": "runs at 1x, 1.25x, 1.5x the tokens (validation loss)"}
    row = {"algorithm": "streaming-diloco", "label": "streaming-diloco", "seconds_per_step": 1.0,
           "exposed_comm_seconds_per_step": 0.0, "cross_site_bytes_per_step": 0.0, "cross_site_bytes_per_run": 0.0,
           "memory_total_gib": 1.0, "memory_gib": {"weights": 1.0}, "train_seconds": 10.0,
           "seconds_to_sync_loss": 15.0, "seconds_to_sync_loss_is_lower_bound": True, "warnings": [],
           "pretrain_gpt_flags": "", "quality": q}
    job = {"sites": 2, "gpus_per_site": [8, 8], "rate_mbit": [1000.0] * 2, "latency_ms": [30.0] * 2,
           "site_factors": [1.0] * 2, "params": 1e9, "tokens_per_step": 1e5, "total_tokens": 2e10, "steps": 1,
           "tensor_parallel": [1, 1], "pipeline_parallel": [1, 1], "recompute": "selective", "notes": []}
    text = plan.table({"job": job, "timing": "t", "rows": [row]})
    assert "| > 1.5 (+5.0% loss at 1x) | >= " in text and "multiplier from runs at 1x, 1.25x, 1.5x" in text


def test_within_a_regime_a_measured_multiplier_beats_a_larger_models_not_reached():
    from tools.planning.evidence import Evidence, Figure, nearest

    def page(path, params, multiplier=None, at_least=None):
        fig = Figure(point="diloco-H30-avg", algorithm="diloco", multiplier=multiplier, final_gap=0.03, seeds=["1"],
                     at_least=at_least)
        return Evidence(path, params=params, tokens=20 * params, seeds=["1"], figures={"diloco": fig})

    s, m = page("S.json", 0.26e6, multiplier=1.37), page("M.json", 0.85e6)
    assert nearest([s, m], "diloco", 1e9, 20).path == "S.json"
    assert nearest([page("S.json", 0.26e6, at_least=1.5), m], "diloco", 1e9, 20).path == "S.json"
    assert nearest([page("S.json", 0.26e6), m], "diloco", 1e9, 20).path == "M.json"  # neither: the larger
    toy = Evidence("toy.json", params=1.8e6, tokens=3 * 1.8e6, seeds=["1"], figures={"diloco": Figure(
        point="diloco", algorithm="diloco", multiplier=0.9, final_gap=-0.01, seeds=["1"])})
    assert nearest([toy, m], "diloco", 1e9, 20).path == "M.json"  # the regime first


def test_a_compressors_point_stands_only_for_a_row_with_that_compressor(tmp_path):
    """The toy pages measured diloco with int4 too (diloco-H25-int4): ending closer to sync's
    loss, it was taken as diloco's figure for rows that send uncompressed. Now each stands for
    its own rows, and a compressed row without a point of its compressor is unmeasured (not the
    uncompressed multiplier, which ranked it as measured)."""
    import plan
    from tools.planning.evidence import compression_of

    sync = [10.0 - 0.1 * i for i in range(20)]
    runs = lambda end: {s: {"train": sync[:-1] + [end] * 5, "valid": [end]} for s in ("1",)}  # noqa: E731
    page = {"argv": ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length",
                     "128", "--global-batch-size", "16", "--train-iters", "1000", "--swiglu"],
            "sync": {"sync": {"1": {"train": sync, "valid": [8.1]}}},
            "results": {"diloco-H25-int4": runs(8.2), "diloco-lr1.0-m0.0": runs(8.4), "dilocox-lowrank4": runs(8.3),
                        "muloco-int4": runs(8.0), "sparseloco-d0.0156": runs(8.5)}}
    path = tmp_path / "quality-x.json"
    path.write_text(json.dumps(page))
    e = read_evidence(str(path))
    assert set(e.figures) == {"diloco", "diloco compression=int4", "dilocox compression=lowrank-int4",
                              "diloco compression=topk-2bit"}  # MuLoCo (Muon inside) stands for no row
    assert e.figures["diloco"].point == "diloco-lr1.0-m0.0"
    assert e.figures["diloco compression=int4"].point == "diloco-H25-int4"
    assert compression_of("diloco-H200-int4") == "int4" and compression_of("diloco-H100") == "none"

    job = Job(sites=2, gpus_per_site=[8, 8], rate_mbit=[1000.0] * 2, latency_ms=[0.0] * 2, site_factors=[1.0] * 2,
              model=Model(params=e.params), tokens_per_step=16 * 128, total_tokens=e.tokens)
    assert plan.quality(job, "diloco", [e], "int4")["point"] == "diloco-H25-int4"
    int8 = plan.quality(job, "diloco", [e], "int8")
    assert int8["multiplier"] is None and "final_gap" not in int8 and "at_least" not in int8
    assert int8["source"].startswith("diloco with --lsgd-compression int8: not measured (uncompressed: quality-x")
    assert plan.quality(job, "dilocox", [e], "int4")["source"].startswith("dilocox with --lsgd-compression int4")


def test_a_rows_h_takes_the_figure_measured_at_it_and_says_when_it_is_another(tmp_path):
    """The planner recommended diloco at H = 100 on the 1 Gbit/s example with H = 30's measured
    1.27x, said only on the evidence line. A point measured at the row's H with budgets is taken
    instead; one at another H is named beside the multiplier."""
    import plan

    sync = [10.0 - 0.1 * i for i in range(20)]
    never = [10.0 - 0.05 * i for i in range(20)]
    runs = lambda valid: {"1": {"train": never, "valid": [valid]}}  # noqa: E731
    page = {"argv": ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length",
                     "128", "--global-batch-size", "16", "--train-iters", "1000", "--swiglu"],
            "sync": {"sync": {"1": {"train": sync, "valid": [4.0]}}},
            "results": {"diloco-H30-avg": runs(4.1), "diloco-H30-avg-x1.25": runs(4.02),
                        "diloco-H30-avg-x1.5": runs(3.98), "diloco-H100-avg": runs(4.2),
                        "diloco-H100-avg-x1.25": runs(4.1), "diloco-H100-avg-x1.5": runs(4.05),
                        "diloco-H200-avg": runs(4.3)},
            "budgets": {f"{b}-x{k:g}": {"base": b, "scale": k} for b in ("diloco-H30-avg", "diloco-H100-avg")
                        for k in (1.25, 1.5)}}
    (tmp_path / "quality-h.json").write_text(json.dumps(page))
    e = read_evidence(str(tmp_path / "quality-h.json"))
    job = Job(sites=2, gpus_per_site=[8, 8], rate_mbit=[1000.0] * 2, latency_ms=[0.0] * 2, site_factors=[1.0] * 2,
              model=Model(params=e.params), tokens_per_step=16 * 128, total_tokens=e.tokens)
    h30, h100 = plan.quality(job, "diloco", [e], interval=30), plan.quality(job, "diloco", [e], interval=100)
    assert h30["point"] == "diloco-H30-avg" and h30["multiplier"] == pytest.approx((1.25 * 1.5) ** 0.5)
    assert "measured_interval" not in h30
    assert h100["point"] == "diloco-H100-avg" and h100["multiplier"] is None and h100["at_least"] == 1.5
    h200 = plan.quality(job, "diloco", [e], interval=200)  # measured there without budgets: the best, named
    assert h200["point"] == "diloco-H30-avg" and h200["measured_interval"] == 30
    row = {"algorithm": "diloco", "label": "diloco", "seconds_per_step": 1.0, "exposed_comm_seconds_per_step": 0.0,
           "cross_site_bytes_per_step": 0.0, "cross_site_bytes_per_run": 0.0, "memory_total_gib": 1.0,
           "memory_gib": {"weights": 1.0}, "train_seconds": 10.0, "seconds_to_sync_loss": 13.7,
           "seconds_to_sync_loss_is_lower_bound": False, "warnings": [], "pretrain_gpt_flags": "", "quality": h200}
    jobd = {"sites": 2, "gpus_per_site": [8, 8], "rate_mbit": [1000.0] * 2, "latency_ms": [30.0] * 2,
            "site_factors": [1.0] * 2, "params": 1e9, "tokens_per_step": 1e5, "total_tokens": 2e10, "steps": 1,
            "tensor_parallel": [1, 1], "pipeline_parallel": [1, 1], "recompute": "selective", "notes": []}
    assert "| 1.37 (at H=30) |" in plan.table({"job": jobd, "timing": "t", "rows": [row]})

