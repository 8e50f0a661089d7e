"""The errors only a process world raises, on 2 launched ranks (tests/errors/test_process_errors.py).

Each step triggers one error of docs/errors.md and prints ``GT {"id", "type", "message"}`` on
the ranks that raise it; the ranks stay in step, so that the next one starts clean. The last
step leaves rank 1 out of a collective, so it runs under a short timeout.
"""
import json
import time

import torch

import globaltensor as gt

S, B = gt.sbp.split, gt.sbp.broadcast
me = gt.rank()
p = gt.placement("cpu", [0, 1])


def expect(entry, fn):
    try:
        fn()
    except Exception as e:
        print("GT " + json.dumps({"id": entry, "type": type(e).__name__, "message": str(e)}), flush=True)
    else:
        print("GT " + json.dumps({"id": entry, "type": None, "message": "no error"}), flush=True)


# pieces that do not follow the balanced split: 2 + 4 rows where S(0) gives 3 + 3
expect("to-global-pieces-not-balanced", lambda: torch.ones(2 + 2 * me, 3).to_global(placement=p, sbp=S(0)))

# an op without a rule, on a placement this rank is not in
alone = gt.distribute(torch.arange(6.0).reshape(2, 3), gt.placement("cpu", [0]), B)
if me == 1:
    expect("fallback-outside-placement", lambda: torch.nonzero(alone))
else:
    torch.nonzero(alone)

x = gt.distribute(torch.arange(12.0).reshape(4, 3), p, S(0))
gt.set_check(True)
expect("check-plain-tensor", lambda: x + torch.full((4, 3), float(me)))     # a "broadcast" mask that differs
expect("check-different-steps", lambda: x.to_global(sbp=B) if me == 1 else x * 2)
gt.set_check(False)

gt.set_timeout(3)
if me == 0:
    expect("collective-did-not-arrive", lambda: x.numpy())    # rank 1 never calls it
else:
    time.sleep(5)
