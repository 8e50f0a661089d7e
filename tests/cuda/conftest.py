"""The CUDA lane: tests of the CUDA path (kernels, streams, NCCL) that run where ``torch.cuda.is_available()``
and are skipped elsewhere (CI has no GPU). ``make test`` on a GPU machine runs them with the rest.

Simulated ranks of a cuda placement all sit on ``cuda:0``; a launched job gets one GPU per local rank.
"""
from __future__ import annotations

import pytest
import torch

NEEDS_CUDA = "needs CUDA (the CUDA lane runs on GPU machines only)"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NEEDS_CUDA)
    for item in items:
        if "tests/cuda/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
