"""Data-parallel and ZeRO training on 2 launched processes, gradients bucketed (overlapped with the
backward) and not, two backwards accumulated per step (the first inside no_sync); prints, as JSON,
whether the gradients, their SBPs and the parameters agree, and the collectives of a step."""
import json
import os

import torch
from torch import nn

import globaltensor as gt
import globaltensor.nn as gnn

S, B = gt.sbp.split, gt.sbp.broadcast


def train(bucket_bytes: int, zero: bool) -> dict:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 10), nn.GELU(), nn.Linear(10, 6), nn.LayerNorm(6), nn.Linear(6, 3)).double()
    placement = gt.placement("cpu", [0, 1])
    gnn.distribute_module(m, placement, bucket_bytes=bucket_bytes)
    opt = (gnn.ZeroOptimizer(m.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9) if zero else
           torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    gt.manual_seed(1)
    grads = []
    for _ in range(2):
        with gt.comm_stats() as stats:
            with gnn.no_sync(m):
                m(gt.randn(8, 6, placement=placement, sbp=S(0), dtype=torch.float64)).square().mean().backward()
            m(gt.randn(8, 6, placement=placement, sbp=S(0), dtype=torch.float64)).square().mean().backward()
            reduced = [p.grad for p in m.parameters()]
        grads.append([(repr(g.sbp), g.full_tensor()) for g in reduced])
        opt.step()
        opt.zero_grad()
    return {"grads": grads, "params": [p.full_tensor() for p in m.parameters()], "ops": stats.ops()}


def compare(zero: bool) -> dict:
    plain, bucketed = train(0, zero), train(25 * 2 ** 20, zero)
    same_sbp = all(a[0] == b[0] for sa, sb in zip(plain["grads"], bucketed["grads"]) for a, b in zip(sa, sb))
    # 2 ranks: every sum has two terms, exact in any order, so bucketed and unbucketed agree exactly
    same_grads = all(torch.equal(a[1], b[1]) for sa, sb in zip(plain["grads"], bucketed["grads"])
                     for a, b in zip(sa, sb))
    same_params = all(torch.equal(a, b) for a, b in zip(plain["params"], bucketed["params"]))
    return {"same_sbp": same_sbp, "same_grads": same_grads, "same_params": same_params,
            "ops_plain": plain["ops"], "ops_bucketed": bucketed["ops"], "n_params": len(plain["params"])}


if __name__ == "__main__":
    result = {"dp": compare(False), "zero": compare(True)}
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(result))
