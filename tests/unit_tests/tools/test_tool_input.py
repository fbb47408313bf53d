"""A damaged cache cell (a truncated JSON file, as a full disk or a killed copy leaves) ends a
benchmark tool with one `error:` line naming the file and where it breaks, exit 2, and the
run is not computed over it silently."""

from __future__ import annotations

import pytest

from tools.benchmarks.run_cache import load_or_run
from tools.benchmarks.spawned_ranks import run_tool


@pytest.mark.parametrize("content", ['{"final_loss": 3.1, "resol', "[1, 2]", "\xff\xfe"])
def test_a_damaged_cache_cell_is_one_error_line(tmp_path, capsys, content):
    cell = tmp_path / "cell.json"
    cell.write_bytes(content.encode("latin-1"))
    computed = []
    with pytest.raises(SystemExit) as exc:
        run_tool(lambda: load_or_run(str(cell), lambda: computed.append(1) or {"x": 1}), "kept")
    err = capsys.readouterr().err
    assert exc.value.code == 2 and not computed
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cached result ") and str(cell) in lines[0], err
    assert "delete it to compute the run again" in lines[0] and "Traceback" not in err


@pytest.mark.parametrize("compute", ["site_factors = [1.0, 0.0]", "microbatch_seconds = 0"])
def test_a_scenario_of_an_impossible_machine_is_refused(tmp_path, compute):
    """A site that computes in no time (a zero slowdown factor or micro-batch time) was
    accepted without a word; it is refused naming the file and the field."""
    from megatron_lsgd.training.scenario import load_scenario

    path = tmp_path / "s.toml"
    path.write_text(f"sites = 2\n[compute]\n{compute}\n")
    with pytest.raises(ValueError) as exc:
        load_scenario(str(path))
    assert str(path) in str(exc.value) and compute.split()[0] in str(exc.value) and "> 0" in str(exc.value)
