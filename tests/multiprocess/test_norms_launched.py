"""Norms of split tensors in a 2-process gloo job (ops/rules/vector_norm.py): each process takes its
piece's norm and the two combine by a collective of scalars -- an all-reduce of powers, an all-gather
for the inf-norms -- eagerly and under ``gt.compile``; ``clip_grad_norm_`` over split gradients sends
one all-reduce of a few scalars. Equal to one device on every rank (float64: the same sums in
another order, ``rtol=1e-12`` as in tests/ops/test_vector_norm.py)."""
from __future__ import annotations

import math

PROGRAM = r'''
import json, math
import torch
import globaltensor as gt

S, B = gt.sbp.split, gt.sbp.broadcast
both = gt.placement("cpu", [0, 1])
gen = torch.Generator().manual_seed(0)
x = torch.randn(7, 5, dtype=torch.float64, generator=gen)
g = gt.distribute(x, both, S(0))
out = {"rank": gt.rank(), "norms": [], "compiled": []}
for p in (2, 1, math.inf, -math.inf, 0, -1):
    with gt.comm_stats() as st:
        got = torch.linalg.vector_norm(g, p)
    want = torch.linalg.vector_norm(x, p)
    out["norms"].append([p, got.item(), want.item(), st.ops(), st.bytes_sent])
norm_of = gt.compile(lambda t: (torch.linalg.vector_norm(t, math.inf), torch.linalg.vector_norm(t, dim=0)))
for k in range(2):
    y = torch.randn(7, 5, dtype=torch.float64, generator=gen)
    a, b = norm_of(gt.distribute(y, both, S(0)))
    out["compiled"].append([(a.full_tensor() - torch.linalg.vector_norm(y, math.inf)).abs().item(),
                            (b.full_tensor() - torch.linalg.vector_norm(y, dim=0)).abs().max().item()])
params = [gt.distribute(torch.randn(s, dtype=torch.float64, generator=gen), both, sbp).requires_grad_()
          for s, sbp in [((6, 4), S(0)), ((4, 6), S(1)), ((4,), B)]]
plain = [p.full_tensor().detach().clone().requires_grad_() for p in params]
for p, q in zip(params, plain):
    q.grad = torch.randn(q.shape, dtype=torch.float64, generator=gen)
    p.grad = gt.distribute(q.grad, p.placement, p.sbp)
with gt.comm_stats() as st:
    total = torch.nn.utils.clip_grad_norm_(params, 0.5)
want = torch.nn.utils.clip_grad_norm_(plain, 0.5)
out["clip"] = {"total": [total.item(), want.item()], "ops": st.ops(), "bytes": st.bytes_sent,
               "diff": max((p.grad.full_tensor() - q.grad).abs().max().item() for p, q in zip(params, plain))}
print("GT " + json.dumps(out))
'''


def test_norms_combine_scalars_across_processes(launch):
    result = launch(PROGRAM, 2)
    records = result.one_record_each((0, 1))
    for rec in records:
        for p, got, want, ops, sent in rec["norms"]:
            assert math.isclose(got, want, rel_tol=1e-12), (p, got, want, rec["rank"])
            assert ops == (["all_gather"] if math.isinf(p) else ["all_reduce"]) and sent <= 16, (p, ops, sent)
        for inf_diff, rows_diff in rec["compiled"]:
            assert inf_diff == 0 and rows_diff < 1e-12, rec["compiled"]
        clip = rec["clip"]
        assert math.isclose(*clip["total"], rel_tol=1e-12), clip
        assert clip["ops"] == ["all_reduce"] and clip["bytes"] <= 32, clip
        assert clip["diff"] < 1e-12, clip
