"""A collective that some rank never joins fails within GT_COLLECTIVE_TIMEOUT, naming the rank and the op."""
from __future__ import annotations

import textwrap

STUCK = """
    import time, torch, globaltensor as gt
    S, B = gt.sbp.split, gt.sbp.broadcast
    p = gt.placement("cpu", ranks=[0, 1])
    x = gt.distribute(torch.arange(12.0).reshape(4, 3), p, S(0))   # a local slice: no communication
    print("ready", flush=True)
    if gt.rank() == 0:
        x.to_global(sbp=B)          # an all-gather that rank 1 never joins
        print("not reached", flush=True)
    else:
        time.sleep(60)
"""


def test_stuck_collective_fails_fast_naming_rank_and_op(launch):
    res = launch(textwrap.dedent(STUCK), 2, check=False, collective_timeout=5)
    assert res.returncode != 0, res.describe()
    assert res.elapsed < 30, "the job waited far past GT_COLLECTIVE_TIMEOUT=5\n" + res.describe()
    assert res.lines(0) == ["ready"] and res.lines(1) == ["ready"], res.describe()
    assert "globaltensor: rank 0: collective all_gather over ranks [0, 1] failed" in res.stderr, res.describe()
    assert "globaltensor.launch: rank 0 exited with code 1; terminated ranks [1]" in res.stderr, res.describe()
