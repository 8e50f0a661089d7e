"""Fixtures of the torch.compile tests: float64 (tests/conftest.py), Dynamo's caches reset around each test, and
``loss.backward()`` traced inside a compiled function (``trace_autograd_ops``, where torch has it)."""
from __future__ import annotations

import os
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)


@pytest.fixture(autouse=True)
def compile_setting(float64):
    import torch._dynamo
    torch._dynamo.reset()
    traced = getattr(torch._dynamo.config, "trace_autograd_ops", None)
    if traced is not None:
        torch._dynamo.config.trace_autograd_ops = True
    try:
        yield
    finally:
        torch._dynamo.reset()
        if traced is not None:
            torch._dynamo.config.trace_autograd_ops = traced
