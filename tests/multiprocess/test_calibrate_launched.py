"""``gt.calibrate()`` in 2 launched gloo processes: it finishes (every rank issues the same
collectives, the bucketed backwards' included), and every rank holds the same figures, its host's
seconds per global op and per bucketed gradient among them."""
from pathlib import Path

PROGRAM = Path(__file__).with_name("_calibrate_program.py")


def test_every_rank_calibrates_alike(launch):
    job = launch(PROGRAM, 2)
    first, second = job.records([0]), job.records([1])
    assert len(first) == len(second) == 1
    assert first == second
    cal = first[0]
    assert cal["backend"] == "gloo" and cal["world_size"] == 2
    assert cal["host_op_seconds"] > 0 and cal["host_gradient_seconds"] > 0
