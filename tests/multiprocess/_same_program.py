"""One program -- random factories, ops, nd boxing, moves between placements, backward -- that
the test runs on 4 simulated ranks and as 4 launched processes; it prints its results as JSON."""
import json
import os

import torch

import globaltensor as gt

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum


def program() -> dict:
    gt.manual_seed(3)
    p1 = gt.placement("cpu", [0, 1, 2, 3])
    p2 = gt.placement("cpu", [[0, 1], [2, 3]])
    sub = gt.placement("cpu", [1, 2])
    x = gt.randn(7, 6, placement=p2, sbp=(S(0), S(1)), requires_grad=True)
    w = gt.randn(6, 5, placement=p2, sbp=(B, S(1)), requires_grad=True)
    y = torch.relu(x @ w)
    z = y.to_global(sbp=(S(1), P))
    m = z.to_global(placement=sub, sbp=S(0))
    b = m.to_global(placement=p1, sbp=B)
    attention_like = torch.softmax(y, -1).sum().to_global(placement=p1, sbp=B)
    loss = (b * b).sum() + attention_like + gt.rand(5, placement=p1, sbp=S(0)).sum()
    with gt.comm_stats() as stats:
        loss.backward()
    out = {name: t.full_tensor().tolist() for name, t in
           {"y": y, "b": b, "loss": loss, "grad_x": x.grad, "grad_w": w.grad}.items()}
    out["sbp"] = [repr(v) for v in (y.sbp, z.sbp, m.sbp, b.sbp, x.grad.sbp, w.grad.sbp)]
    out["backward_bytes"] = stats.bytes_sent
    return out


if __name__ == "__main__":
    result = program()
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(result))
