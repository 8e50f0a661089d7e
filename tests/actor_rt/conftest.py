"""Fixtures of the gt.compile tests: float64 by default, the stage placements, gt.nn's test models.

Every test here compares a compiled call with the same eager computation; float64 makes
"equal" mean equal up to the last bits (and exactly where only data moves).
"""
from __future__ import annotations

import os
import sys

import pytest

import globaltensor as gt

_NN_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nn")
if _NN_TESTS not in sys.path:                  # nn_models: the Megatron-plannable Net of tests/nn
    sys.path.insert(0, _NN_TESTS)


@pytest.fixture(autouse=True)
def every_test_in_float64(float64):
    """The suite's ``float64`` fixture (tests/conftest.py) for every test here."""


@pytest.fixture
def pa(world4):
    """Stage 1 of a 2-stage pipeline: ranks [0, 1]."""
    return gt.placement("cpu", [0, 1])


@pytest.fixture
def pb(world4):
    """Stage 2 of a 2-stage pipeline: ranks [2, 3]."""
    return gt.placement("cpu", [2, 3])
