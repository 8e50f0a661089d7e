"""A collective that some rank never joins fails within GT_COLLECTIVE_TIMEOUT, naming the rank and the op.

Each bound on a wait is what the test promises, not a figure for a quiet machine: the job ends before
the rank it must not wait for would wake, or before the collective timeout it must not wait out."""
from __future__ import annotations

import textwrap
import time

STUCK = """
    import time, torch, globaltensor as gt
    S, B = gt.sbp.split, gt.sbp.broadcast
    p = gt.placement("cpu", ranks=[0, 1])
    x = gt.distribute(torch.arange(12.0).reshape(4, 3), p, S(0))   # a local slice: no communication
    print("ready", time.time(), flush=True)
    if gt.rank() == 0:
        x.to_global(sbp=B)          # an all-gather that rank 1 never joins
        print("not reached", flush=True)
    else:
        time.sleep(SLEEP_S)
"""


SLEEP_S = 60


def test_stuck_collective_fails_fast_naming_rank_and_op(launch):
    res = launch(textwrap.dedent(STUCK).replace("SLEEP_S", str(SLEEP_S)), 2, check=False, collective_timeout=5)
    ended = time.time()
    assert res.returncode != 0, res.describe()
    ready = [[float(line.split()[1]) for line in res.lines(r) if line.startswith("ready ")] for r in range(2)]
    assert all(len(t) == 1 for t in ready) and not any("not reached" in res.lines(r) for r in range(2)), res.describe()
    # from the moment both ranks were ready: the 5 s collective timeout and the teardown, not rank 1's sleep
    waited = ended - max(t[0] for t in ready)
    assert waited < SLEEP_S, f"the job ended {waited:.1f} s after the stuck collective began, not before rank 1 " \
        f"woke ({SLEEP_S} s)\n" + res.describe()
    assert "globaltensor: rank 0: collective all_gather over ranks [0, 1] failed" in res.stderr, res.describe()
    assert "globaltensor.launch: rank 0 exited with code 1; terminated ranks [1]" in res.stderr, res.describe()


EXITS = """
    import sys, time, torch, globaltensor as gt
    S, B = gt.sbp.split, gt.sbp.broadcast
    p = gt.placement("cpu", ranks=[0, 1])
    x = gt.distribute(torch.arange(12.0).reshape(4, 3), p, S(0))
    x.to_global(sbp=B)                     # both ranks are in the process world
    print("ready", time.time(), flush=True)
    if gt.rank() == 1:
        sys.exit(3)                        # gives up cleanly, with an exit code
    x.to_global(sbp=B)                     # rank 0 waits for rank 1 here
    print("not reached", flush=True)
"""


EXIT_TIMEOUT_S = 60


def test_rank_calling_sys_exit_ends_the_job_before_the_collective_timeout(launch):
    """No hook sees a SystemExit's code, so the rank's exit barrier runs: it must be short."""
    res = launch(textwrap.dedent(EXITS), 2, check=False, collective_timeout=EXIT_TIMEOUT_S,
                 env={"GT_EXIT_BARRIER_TIMEOUT": "3"})
    ended = time.time()
    assert res.returncode != 0, res.describe()
    ready = [[float(line.split()[1]) for line in res.lines(r) if line.startswith("ready ")] for r in range(2)]
    assert all(len(t) == 1 for t in ready), res.describe()
    waited = ended - max(t[0] for t in ready)
    assert waited < EXIT_TIMEOUT_S, f"the job ended {waited:.1f} s after rank 1 exited, not before the collective " \
        f"timeout ({EXIT_TIMEOUT_S} s)\n" + res.describe()
    assert "globaltensor.launch: rank " in res.stderr and "exited with code" in res.stderr, res.describe()
    assert not any("not reached" in res.lines(r) for r in range(2)), res.describe()
