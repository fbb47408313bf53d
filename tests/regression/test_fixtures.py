"""sync, diloco and dilocox reproduce their recorded numbers bit for bit (tests/regression/
runs.py explains the fixtures and how to regenerate them when a change means to move them)."""

import json

import pytest

from tests.regression.runs import CONFIGS, COMMON, FIXTURES, LAYOUTS, run_layout

with open(FIXTURES) as f:
    RECORDED = json.load(f)


def test_fixtures_describe_these_runs():
    assert RECORDED["common_args"] == COMMON and RECORDED["layouts"] == LAYOUTS and RECORDED["configs"] == CONFIGS


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_numbers_do_not_move(layout):
    now = run_layout(layout)
    for name, expected in RECORDED["runs"][layout].items():
        got = now[name]
        assert len(got["losses"]) == 8, name
        assert got["losses"] == expected["losses"], f"{layout}/{name}: losses moved"
        assert got["param_sha256"] == expected["param_sha256"], f"{layout}/{name}: final parameters moved"
