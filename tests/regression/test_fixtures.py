"""sync, diloco and dilocox reproduce their recorded numbers bit for bit (tests/regression/
runs.py explains the fixtures, why there is one record per platform, and how to record)."""

import json

import pytest

from tests.regression.runs import CONFIGS, COMMON, FIXTURES, LAYOUTS, run_layout
from tools.benchmarks.run_cache import platform_signature

with open(FIXTURES) as f:
    RECORDED = json.load(f)


def test_fixtures_describe_these_runs():
    assert RECORDED["common_args"] == COMMON and RECORDED["layouts"] == LAYOUTS and RECORDED["configs"] == CONFIGS
    assert RECORDED["platforms"], "no platform recorded"
    for signature, runs in RECORDED["platforms"].items():
        assert set(runs) == set(LAYOUTS), signature
        for layout in LAYOUTS:  # a configuration added later is missing from older platforms' records
            assert set(runs[layout]) <= set(CONFIGS), (signature, layout)
    for layout in LAYOUTS:
        for name in CONFIGS:
            assert any(name in runs[layout] for runs in RECORDED["platforms"].values()), f"{layout}/{name} never recorded"


def differences(now, recorded):
    """The configurations whose losses or final parameters differ from one platform's record."""
    moved = []
    for name, expected in recorded.items():
        got = now[name]
        if got["losses"] != expected["losses"]:
            moved.append(f"{name}: losses")
        elif got["param_sha256"] != expected["param_sha256"]:
            moved.append(f"{name}: final parameters")
    return moved


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_numbers_do_not_move(layout):
    now = run_layout(layout)
    assert all(len(run["losses"]) == 8 for run in now.values())
    report = {signature: differences(now, runs[layout]) for signature, runs in RECORDED["platforms"].items()}
    if any(not moved for moved in report.values()):
        return
    here = platform_signature()
    lines = [f"{layout}: the numbers match no recorded platform"]
    lines += [f"  vs {signature}: {', '.join(moved)}" for signature, moved in report.items()]
    if here not in RECORDED["platforms"]:
        lines.append(f"  this platform ({here}) has no record: if the code's numbers did not move, record it "
                     "from unchanged code (python -m tests.regression.record) in a commit of its own")
    pytest.fail("\n".join(lines), pytrace=False)
