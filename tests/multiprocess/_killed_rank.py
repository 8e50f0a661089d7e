"""A rank killed (SIGKILL) while its peer waits for it in a collective: tests/multiprocess/test_killed_rank.py.

``_killed_rank.py eager|compiled``: 2 ranks run a step -- an op, then an all-gather -- eagerly or
through gt.compile (warm-up and capture first); then rank 1 kills itself inside the op, while
rank 0 goes on into the all-gather. Rank 0 ignores SIGTERM (under the launcher), so that how its
collective ends shows before the launcher's SIGKILL: it prints ``ERROR {json}`` and re-raises.
"""
import json
import os
import signal
import sys
import time

import torch

import globaltensor as gt

S, B = gt.sbp.split, gt.sbp.broadcast
KILL = {"on": False}


@torch.library.custom_op("gt_killed_rank::maybe_die", mutates_args=())
def maybe_die(t: torch.Tensor) -> torch.Tensor:
    if KILL["on"] and gt.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return t * 2.0


@maybe_die.register_fake
def _maybe_die_fake(t):
    return torch.empty_like(t)


gt.register_rule(torch.ops.gt_killed_rank.maybe_die.default, ["S(0) -> S(0)", "B -> B"])


def step(x):
    return torch.ops.gt_killed_rank.maybe_die(x).to_global(sbp=B)


mode, launcher = sys.argv[1], sys.argv[2]
p = gt.placement("cpu", [0, 1])
x = gt.distribute(torch.arange(12.0).reshape(4, 3), p, S(0))
if mode == "compiled":
    step = gt.compile(step)
    step(x)
    step(x)                    # warm-up, then capture: the next call runs the graph
step(x)
if launcher == "launch" and gt.rank() == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
sys.stdout.write(f"ready {time.time()}\n")   # one write: torchrun's ranks share one stdout pipe
sys.stdout.flush()
x.to_global(sbp=B)            # both ranks have said "ready" before rank 1 dies (a slow rank 0 would not have)
KILL["on"] = True
try:
    step(x)
except Exception as e:
    print("ERROR " + json.dumps({"type": type(e).__name__, "message": str(e)}), flush=True)
    raise
print("not reached", flush=True)
