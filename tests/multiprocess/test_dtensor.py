"""Global tensors to DTensor and back, and a parallelize_module model taken over and handed back, on
2 and 4 launched gloo processes, and DCP checkpoints of either library loaded by the other (the
checks are in _dtensor_program.py, on every rank)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

PROGRAM = Path(__file__).with_name("_dtensor_program.py")


@pytest.mark.parametrize("nproc,min_checks", [(2, 120), (4, 250)])
def test_dtensor_round_trips(launch, tmp_path, nproc, min_checks):
    job = launch(PROGRAM, nproc, args=[str(tmp_path)])
    line = next(l for l in job.lines(0) if l.startswith("DONE "))
    done = json.loads(line[len("DONE "):])
    assert done["ranks"] == nproc and done["checks"] >= min_checks, done
