"""Pipeline schedules in a process world (tests/multiprocess/_schedules_program.py): one stage per
gloo process, each rank running its own streams, every schedule equal to the plain chain in float64
at 2 and 4 processes."""
from __future__ import annotations

from pathlib import Path

import pytest

PROGRAM = Path(__file__).with_name("_schedules_program.py")
EXACT = 1e-12                  # float64: the micro-batches' means summed in another order


@pytest.mark.parametrize("nproc, schedules", [(2, ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"]),
                                              (4, ["1f1b", "interleaved_1f1b", "zero_bubble"])])
def test_every_schedule_trains_as_one_device_on_processes(launch, nproc, schedules):
    result = launch(PROGRAM, nproc, args=schedules)
    records = result.records(range(nproc))
    assert len(records) == nproc * len(schedules), result.describe()
    for rec in records:
        assert rec["loss_error"] <= EXACT and rec["weight_error"] <= EXACT, rec
        assert rec["schedule"] == "gpipe" or f"over {nproc} stages" in rec["plan"], rec
