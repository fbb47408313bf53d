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
