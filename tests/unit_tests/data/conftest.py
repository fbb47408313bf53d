"""Fixtures for the data-pipeline tests."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import datatest_utils  # noqa: E402,F401 - puts tools/ on sys.path


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)
