"""launch.run forks its ranks from the preloaded server: a rank that fails must still fail the
run, with the job's log (or every test built on it could pass on a job that never ran)."""

import pytest

from tests.unit_tests.checkpointing.launch import TINY, run


def test_a_failing_rank_fails_the_run_with_its_log(tmp_path):
    with pytest.raises(AssertionError, match="error: .*--lr"):
        run(TINY + ["--train-iters", "2", "--lr", "nan"], 2, str(tmp_path / "bad.log"))
