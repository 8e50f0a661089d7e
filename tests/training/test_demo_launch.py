"""examples/demo.py as 4 launched processes gives the losses (and the communication counts) of the
same demo on 4 simulated ranks in this process."""
from __future__ import annotations

import re

import pytest

import globaltensor as gt
from training_helpers import EXAMPLES

DEMO = EXAMPLES / "demo.py"
STEPS = 3
STEP_LINE = re.compile(r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+\S+\s+([\d,]+)\s+\d+\s+[\d.]+s$")


def _steps(lines):
    rows = [STEP_LINE.match(line) for line in lines]
    return [(float(m[2]), float(m[3]), int(m[4].replace(",", ""))) for m in rows if m]


@pytest.fixture(scope="module")
def simulated():
    import demo
    with gt.simulate(4):
        return demo.train(steps=STEPS)


def test_demo_simulated_matches_single_device(simulated):
    assert simulated["params_close"]
    for a, b in zip(simulated["losses"], simulated["reference"]):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-5)
    assert simulated["losses"][-1] < simulated["losses"][0]


def test_demo_launched_as_4_processes_matches_the_simulated_run(launch, simulated):
    # a generous collective timeout: the first step (signature inference on every rank) is slow on a
    # loaded 2-core machine, and a rank may wait long for the others
    result = launch(DEMO, 4, args=["--steps", str(STEPS)], timeout=300, collective_timeout=120)
    lines = result.lines(0)
    steps = _steps(lines)
    assert len(steps) == STEPS, "rank 0 printed a line per step:\n" + result.describe()
    assert any(line.startswith("OK:") for line in lines), result.describe()
    assert any("4 processes" in line for line in lines)
    for r in (1, 2, 3):
        assert result.lines(r) == [], f"rank {r} printed on stdout; only rank 0 should"
    for (loss, ref, sent), sim_loss, sim_ref, sim_sent in zip(steps, simulated["losses"], simulated["reference"],
                                                             simulated["bytes_sent"]):
        assert loss == pytest.approx(sim_loss, rel=1e-4, abs=2e-6)
        assert ref == pytest.approx(sim_ref, abs=2e-6), "the single-device reference is the same program"
        assert sent == sim_sent, "a process world counts communication as the simulated one does"
