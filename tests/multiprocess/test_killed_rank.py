"""A rank killed while its peer waits for it in a collective ends the job within seconds: a compiled
job under globaltensor.launch, an eager one under torchrun (_killed_rank.py).

The peer's collective fails as soon as the killed rank's connections close -- not at the
collective timeout, here 60 s -- and its error names the rank that did not arrive; the launcher
(or torchrun's agent) then ends the job, naming the killed rank. The bound on the wait is what is
promised: less than the collective timeout (a peer that waited for it would take at least that long),
not a figure for a quiet machine.
"""
from __future__ import annotations

import json
import re
import signal
import sys
import time
from pathlib import Path

PROGRAM = Path(__file__).with_name("_killed_rank.py")
TIMEOUT_S = 60           # the collective timeout: the job must end before it
JOB_LIMIT_S = 240        # the whole job, its interpreters' start and the compiled warm-up included


def _since_ready(result, ended: float) -> float:
    ready = [float(line.split()[1]) for r in (0, 1) for line in result.lines(r) if line.startswith("ready ")]
    assert len(ready) == 2, "the ranks did not both reach the step\n" + result.describe()
    return ended - max(ready)


def test_killed_rank_ends_a_compiled_launched_job(launch):
    result = launch(PROGRAM, 2, args=["compiled", "launch"], check=False, collective_timeout=TIMEOUT_S,
                    timeout=JOB_LIMIT_S)
    waited = _since_ready(result, time.time())
    assert result.returncode == 128 + signal.SIGKILL, result.describe()
    # the killed rank, the first to end, is the one reported (rank 0 may be gone by the time it is terminated)
    assert re.search(r"globaltensor\.launch: rank 1 was killed by signal 9 \(SIGKILL\)(; terminated ranks \[0\])?\n",
                     result.stderr), result.describe()
    errors = [json.loads(line[len("ERROR "):]) for line in result.lines(0) if line.startswith("ERROR ")]
    assert errors, "rank 0 did not report how its step ended\n" + result.describe()
    msg = errors[0]["message"]
    assert errors[0]["type"] == "GraphError" and "op all_gather, rank 0" in msg, msg
    assert "collective all_gather over ranks [0, 1] failed" in msg and "ranks [1] did not arrive" in msg, msg
    assert waited < TIMEOUT_S, f"the job ended {waited:.1f} s after the kill, not before the collective " \
        f"timeout ({TIMEOUT_S} s)\n" + result.describe()
    assert "not reached" not in result.stdout, result.describe()


def test_killed_rank_ends_an_eager_torchrun_job(launch_tools):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(launch_tools.free_port()), str(PROGRAM), "eager", "torchrun"]
    result = launch_tools.run_job(cmd, env=launch_tools.job_env(TIMEOUT_S), timeout=JOB_LIMIT_S)
    ended = time.time()
    ready = [float(line.split()[1]) for line in result.stdout.splitlines() if line.startswith("ready ")]
    assert len(ready) == 2, "the ranks did not both reach the step\n" + result.describe()
    assert result.returncode != 0, result.describe()
    assert "exitcode  : -9" in result.stderr and "(SIGKILL)" in result.stderr, result.describe()
    assert ended - max(ready) < TIMEOUT_S, f"the job ended {ended - max(ready):.1f} s after the kill, not before " \
        f"the collective timeout ({TIMEOUT_S} s)\n" + result.describe()
    assert "not reached" not in result.stdout, result.describe()
