"""The same program on 4 simulated ranks and as 4 launched processes gives the same results."""
import json
import sys
from pathlib import Path

import numpy as np

import globaltensor as gt

sys.path.insert(0, str(Path(__file__).parent))
from _same_program import program  # noqa: E402

PROGRAM = Path(__file__).with_name("_same_program.py")


def test_simulated_and_launched_runs_agree(launch):
    with gt.simulate(4):
        simulated = program()
    job = launch(PROGRAM, 4)
    line = next(l for l in job.lines(0) if l.startswith("RESULT "))
    launched = json.loads(line[len("RESULT "):])
    assert launched["sbp"] == simulated["sbp"]
    assert launched["backward_bytes"] == simulated["backward_bytes"] > 0
    for name in ("y", "b", "loss", "grad_x", "grad_w"):
        np.testing.assert_allclose(np.array(launched[name]), np.array(simulated[name]), rtol=1e-5, atol=1e-6,
                                   err_msg=name)
    assert np.array(simulated["grad_x"]).shape == (7, 6) and np.abs(simulated["grad_x"]).sum() > 0
