"""examples/demo.py: its verdict (in float64, the 4-rank run equals the single-device run and the compiled
run the eager one, to demo.TOLERANCE) holds on 4 simulated ranks and on 4 launched processes, and the
launched demo prints the table of the simulated one."""
from __future__ import annotations

import re

import pytest
import torch

import globaltensor as gt
from training_helpers import EXAMPLES

DEMO = EXAMPLES / "demo.py"
STEPS = 3
# step, losses (4 ranks, compiled, 1 device), bytes (eager, compiled), collectives (eager, compiled), times, mode
STEP_LINE = re.compile(r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d,]+)\s+([\d,]+)\s+(\d+)\s+(\d+)"
                       r"\s+[\d.]+s\s+[\d.]+s( \(.+\))?$")


def _steps(lines):
    rows = [STEP_LINE.match(line) for line in lines]
    return [{"reference": m[4], "bytes": (int(m[5].replace(",", "")), int(m[6].replace(",", ""))),
             "eager collectives": int(m[7])} for m in rows if m]


@pytest.fixture(scope="module")
def simulated():
    """The demo's float32 table run and its float64 check run, on 4 simulated ranks."""
    import demo
    with gt.simulate(4):
        return demo, demo.train(steps=STEPS), demo.train(steps=STEPS, dtype=torch.float64, show=False)


def test_demo_verdict_holds_on_simulated_ranks(simulated):
    demo, table, check = simulated
    for what, (loss_err, param_err) in check["errors"].items():
        assert loss_err <= demo.TOLERANCE and param_err <= demo.TOLERANCE, (what, loss_err, param_err)
    assert demo.verdict(check)
    for run in (table, check):
        assert run["captures"] == 1 and len(run["losses"]["compiled"]) == STEPS
        assert run["losses"]["eager"][-1] < run["losses"]["eager"][0], "the model trains"
    # both steps reduce the data-parallel gradients in buckets: the same collectives, the same bytes
    assert table["bytes_sent"]["compiled"] == table["bytes_sent"]["eager"]
    assert table["collectives"]["compiled"][-1] == table["collectives"]["eager"][-1]


def test_demo_launched_as_4_processes_prints_ok_and_the_simulated_table(launch, simulated):
    _, table, _ = simulated
    # a generous collective timeout: the first step (signature inference on every rank) and the
    # capture are slow on a loaded 2-core machine, and a rank may wait long for the others
    result = launch(DEMO, 4, args=["--steps", str(STEPS)], timeout=300, collective_timeout=120)
    lines = result.lines(0)
    steps = _steps(lines)
    assert len(steps) == STEPS, "rank 0 printed a line per step:\n" + result.describe()
    assert any(line.startswith("OK:") for line in lines), result.describe()
    assert any("4 processes" in line for line in lines)
    for r in (1, 2, 3):     # (torch's own gloo prints "[Gloo] Rank r is connected to ..." on some releases)
        printed = [line for line in result.lines(r) if not line.startswith("[Gloo] ")]
        assert printed == [], f"rank {r} printed on stdout; only rank 0 should"
    for i, row in enumerate(steps):
        # the same float32 program on the same machine, one thread each: the same bits
        assert row["reference"] == f"{table['losses']['reference'][i]:.6f}", "the same data and init"
        assert row["bytes"] == (table["bytes_sent"]["eager"][i], table["bytes_sent"]["compiled"][i]), \
            "a process world counts communication as the simulated one does"
        assert row["eager collectives"] == table["collectives"]["eager"][i]
