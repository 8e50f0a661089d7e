"""A collective that some rank never joins fails within GT_COLLECTIVE_TIMEOUT, naming the rank and the op."""
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
        time.sleep(60)
"""


def test_stuck_collective_fails_fast_naming_rank_and_op(launch):
    res = launch(textwrap.dedent(STUCK), 2, check=False, collective_timeout=5)
    ended = time.time()
    assert res.returncode != 0, res.describe()
    ready = [[float(line.split()[1]) for line in res.lines(r) if line.startswith("ready ")] for r in range(2)]
    assert all(len(t) == 1 for t in ready) and not any("not reached" in res.lines(r) for r in range(2)), res.describe()
    # from the moment both ranks were ready: the 5 s collective timeout and the teardown, not rank 1's 60 s
    waited = ended - max(t[0] for t in ready)
    assert waited < 25, f"the job ended {waited:.1f} s after the stuck collective began\n" + res.describe()
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


def test_rank_calling_sys_exit_ends_the_job_before_the_collective_timeout(launch):
    """No hook sees a SystemExit's code, so the rank's exit barrier runs: it must be short."""
    res = launch(textwrap.dedent(EXITS), 2, check=False, collective_timeout=60,
                 env={"GT_EXIT_BARRIER_TIMEOUT": "3"})
    ended = time.time()
    assert res.returncode != 0, res.describe()
    ready = [[float(line.split()[1]) for line in res.lines(r) if line.startswith("ready ")] for r in range(2)]
    assert all(len(t) == 1 for t in ready), res.describe()
    waited = ended - max(t[0] for t in ready)
    assert waited < 40, f"the job ended {waited:.1f} s after rank 1 exited (collective timeout 60 s)\n" + res.describe()
    assert "globaltensor.launch: rank " in res.stderr and "exited with code" in res.stderr, res.describe()
    assert not any("not reached" in res.lines(r) for r in range(2)), res.describe()
