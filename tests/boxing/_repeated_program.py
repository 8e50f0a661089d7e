"""Run by test_repeated_launched.py on every rank: each 1-D conversion of a few shapes, done twice
from one source. Prints ``RESULT {json}``: the failed checks and how many ran."""
import json

import torch

import globaltensor as gt
from globaltensor.comm import get_world

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
SBPS = {"S0": S(0), "S1": S(1), "B": B, "P": P}

world = get_world()
me, n = world.rank, world.size
pl = gt.placement("cpu", ranks=list(range(n)))
failures, checks = [], 0


def check(what, ok):
    global checks
    checks += 1
    if not ok:
        failures.append(what)


for shape in [(8, 6), (7, 5), (2, 9)]:
    torch.manual_seed(sum(shape))
    full = torch.randint(-50, 50, shape).to(torch.float64)       # integers: every sum is exact
    for a, x in SBPS.items():
        for b, y in SBPS.items():
            if a == b:
                continue
            what = f"{shape} {a}->{b}"
            if x.is_partial:   # rank r holds (r + 1) * full: the logical tensor is their sum
                src = (full * (me + 1)).to_global(placement=pl, sbp=P)
                want = full * (n * (n + 1) // 2)
            else:
                src = gt.distribute(full, pl, x)
                want = full
            before = src.to_local().clone()
            first = src.to_global(sbp=y)
            kept = first.to_local().clone()
            second = src.to_global(sbp=y)
            check(f"{what}: the source piece changed", torch.equal(src.to_local(), before))
            check(f"{what}: the second result changed the first", torch.equal(first.to_local(), kept))
            check(f"{what}: the two results differ", torch.equal(first.to_local(), second.to_local()))
            if first.to_local().numel():
                check(f"{what}: the two results share memory",
                      first.to_local().untyped_storage().data_ptr() != second.to_local().untyped_storage().data_ptr())
            check(f"{what}: wrong value", torch.equal(second.full_tensor(), want))

print("RESULT " + json.dumps({"failures": failures, "checks": checks}), flush=True)
