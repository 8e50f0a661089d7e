"""A rank killed while its peer waits for it in a collective ends the job within seconds: a compiled
job under globaltensor.launch, an eager one under torchrun (_killed_rank.py).

The peer's collective fails as soon as the killed rank's connections close -- not at the
collective timeout, here 60 s -- and its error names the rank that did not arrive; the launcher
(or torchrun's agent) then ends the job, naming the killed rank.
"""
from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

PROGRAM = Path(__file__).with_name("_killed_rank.py")
TIMEOUT_S = 60           # the collective timeout: the job must end long before it
PROMPT_S = 20            # "within seconds", on a loaded 2-core machine


def _since_ready(result, ended: float) -> float:
    ready = [float(line.split()[1]) for r in (0, 1) for line in result.lines(r) if line.startswith("ready ")]
    assert len(ready) == 2, "the ranks did not both reach the step\n" + result.describe()
    return ended - max(ready)


def test_killed_rank_ends_a_compiled_launched_job(launch):
    result = launch(PROGRAM, 2, args=["compiled", "launch"], check=False, collective_timeout=TIMEOUT_S, timeout=90)
    waited = _since_ready(result, time.time())
    assert result.returncode == 128 + signal.SIGKILL, result.describe()
    assert "globaltensor.launch: rank 1 was killed by signal 9 (SIGKILL); terminated ranks [0]" in result.stderr, \
        result.describe()
    errors = [json.loads(line[len("ERROR "):]) for line in result.lines(0) if line.startswith("ERROR ")]
    assert errors, "rank 0 did not report how its step ended\n" + result.describe()
    msg = errors[0]["message"]
    assert errors[0]["type"] == "GraphError" and "op all_gather, rank 0" in msg, msg
    assert "collective all_gather over ranks [0, 1] failed" in msg and "ranks [1] did not arrive" in msg, msg
    assert waited < PROMPT_S, f"the job ended {waited:.1f} s after the kill\n" + result.describe()
    assert "not reached" not in result.stdout, result.describe()


def test_killed_rank_ends_an_eager_torchrun_job(launch_tools):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(launch_tools.free_port()), str(PROGRAM), "eager", "torchrun"]
    result = launch_tools.run_job(cmd, env=launch_tools.job_env(TIMEOUT_S), timeout=90)
    ended = time.time()
    ready = [float(line.split()[1]) for line in result.stdout.splitlines() if line.startswith("ready ")]
    assert len(ready) == 2, "the ranks did not both reach the step\n" + result.describe()
    assert result.returncode != 0, result.describe()
    assert "exitcode  : -9" in result.stderr and "(SIGKILL)" in result.stderr, result.describe()
    assert ended - max(ready) < PROMPT_S, f"the job ended {ended - max(ready):.1f} s after the kill\n" + \
        result.describe()
    assert "not reached" not in result.stdout, result.describe()
