"""Conversions repeated on launched gloo processes: a process world keeps scratch buffers for its
collectives' temporaries, and a plan made ready once runs each time -- every result must still be
fresh memory of its own, the source untouched, the value right (2 and 4 processes, uneven shapes)."""
import json
from pathlib import Path

import pytest

PROGRAM = Path(__file__).with_name("_repeated_program.py")


@pytest.mark.parametrize("nproc", [2, 4])
def test_repeated_conversions_on_processes(launch, nproc):
    job = launch(PROGRAM, nproc)
    for rank in range(nproc):
        line = next(l for l in job.lines(rank) if l.startswith("RESULT "))
        result = json.loads(line[len("RESULT "):])
        assert result["checks"] >= 3 * 12 * 4, result["checks"]
        assert not result["failures"], f"rank {rank}: " + "; ".join(result["failures"][:20])
