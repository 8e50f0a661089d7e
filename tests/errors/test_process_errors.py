"""The catalogue's process-world errors (docs/errors.md), raised on 2 launched gloo ranks.

One launch of ``_process_errors.py`` triggers them in turn (each rank prints a ``GT`` record per
error it raised); each is compared with its entry here. The last one, a collective that rank 1
never joins, runs under a 3 s timeout and must name rank 1 as the rank that did not arrive and
``numpy()`` as the method every rank must call.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from catalogue import entries

PROGRAM = Path(__file__).with_name("_process_errors.py")
RECORD = re.compile(r"^\[rank (\d+)\] GT (.*)$")
# entry id -> the ranks that raise it
PROCESS_ENTRIES = {
    "to-global-pieces-not-balanced": [0, 1],
    "fallback-outside-placement": [1],
    "local-map-outside-placement": [1],
    "local-map-result-shape-changed": [0, 1],
    "check-plain-tensor": [0, 1],
    "check-different-steps": [0, 1],
    "dtensor-mesh-not-ascending": [0, 1],
    "to-dtensor-mesh-differs": [0, 1],
    "from-dtensor-placement": [0, 1],
    "from-dtensor-shard-order": [0, 1],
    "collective-did-not-arrive": [0],
    # the ranks whose local rank has no GPU of its own: both on a machine without CUDA
    "process-cuda-devices": [r for r in (0, 1) if r >= (torch.cuda.device_count() if torch.cuda.is_available() else 0)],
}


@pytest.fixture(scope="module")
def job(launch):
    result = launch(PROGRAM, 2, check=False, timeout=90)
    records = {}
    for line in result.stdout.splitlines():
        m = RECORD.match(line)
        if m:
            rec = json.loads(m.group(2))
            records[(rec["id"], int(m.group(1)))] = rec
    return result, records


def _has_shard_orders() -> bool:
    try:
        from torch.distributed.tensor._dtensor_spec import ShardOrderEntry  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("entry_id", list(PROCESS_ENTRIES))
def test_process_error_is_raised_as_documented(job, entry_id):
    if entry_id == "from-dtensor-shard-order" and not _has_shard_orders():
        pytest.skip(f"torch {torch.__version__} has no DTensor shard orders (ShardOrderEntry came with 2.10)")
    result, records = job
    entry = entries()[entry_id]
    for rank in PROCESS_ENTRIES[entry_id]:
        rec = records.get((entry_id, rank))
        assert rec is not None, f"rank {rank} never reported {entry_id}\n" + result.describe()
        assert rec["type"] == entry.type, f"{entry_id} on rank {rank}: raised {rec['type']}: {rec['message']}"
        assert entry.matches(rec["message"]), \
            f"{entry_id} on rank {rank}: the message\n  {rec['message']}\ndoes not match the documented\n  {entry.message}"
    assert result.returncode == 0, result.describe()


def test_the_collective_timeout_names_the_missing_rank_and_the_method(job):
    result, records = job
    msg = records[("collective-did-not-arrive", 0)]["message"]
    assert "ranks [1] did not arrive (rank 1: last seen in no collective" in msg, msg
    assert "numpy() is a collective: every rank of the placement [0, 1] must call it" in msg, msg
    assert "Timed out waiting 3000ms" in msg, msg       # gt.set_timeout(3) retimed the existing group
