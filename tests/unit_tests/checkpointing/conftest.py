"""Fixtures shared by the checkpoint tests: one small saved checkpoint per session, and a
fresh copy of it per test (tests may corrupt, lock or delete their copy)."""

from __future__ import annotations

import shutil

import pytest

from tests.unit_tests.checkpointing.single import run_single


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("base") / "ckpt")
    with pytest.MonkeyPatch.context() as mp:
        assert run_single(["--train-iters", "2", "--save", path], mp) == 0
    return path


@pytest.fixture
def ckpt(saved, tmp_path):
    path = str(tmp_path / "ckpt")
    shutil.copytree(saved, path)
    return path
