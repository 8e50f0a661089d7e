"""Pipeline schedules in a process world (tests/multiprocess/_schedules_program.py): one stage per
gloo process, or stages of 2 data-parallel processes each, each rank running its own streams;
every schedule (zbv's chunks going down the stages and back up) equal to the plain chain in float64 at 2 and 4 processes; and transformers' Llama cut
into 2 stages, whose rotary tables go from the first stage to every layer's."""
from __future__ import annotations

from pathlib import Path

import pytest

PROGRAM = Path(__file__).with_name("_schedules_program.py")
EXACT = 1e-12                  # float64: the micro-batches' means summed in another order


@pytest.mark.parametrize("nproc, stages, schedules", [
    (2, 2, ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv"]),
    (4, 4, ["1f1b", "interleaved_1f1b", "zero_bubble", "zbv"]),
    (4, 2, ["1f1b", "interleaved_1f1b", "zero_bubble", "zbv"])], ids=["2x1", "4x1", "2x2-data-parallel"])
def test_every_schedule_trains_as_one_device_on_processes(launch, nproc, stages, schedules):
    result = launch(PROGRAM, nproc, args=schedules + (["--data-parallel"] if stages < nproc else []))
    records = result.records(range(nproc))
    assert len(records) == nproc * len(schedules), result.describe()
    for rec in records:
        assert rec["loss_error"] <= EXACT and rec["weight_error"] <= EXACT, rec
        assert rec["schedule"] == "gpipe" or f"over {stages} stages" in rec["plan"], rec


def test_hf_llama_in_stages_trains_as_one_device_on_processes(launch):
    """Each process sees only its side of every transfer; the two sides must order their messages
    alike (the rotary tables' transfers skip chunks under interleaving, and go back to the first
    stage's last chunk under zbv)."""
    schedules = ["1f1b", "interleaved_1f1b", "zero_bubble", "zbv"]
    result = launch(PROGRAM, 2, args=schedules + ["--hf"])
    records = result.records(range(2))
    assert len(records) == 2 * len(schedules), result.describe()
    for rec in records:
        assert rec["loss_error"] <= EXACT and "over 2 stages" in rec["plan"], rec
