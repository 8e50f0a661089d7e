"""The optimizer's update on pieces (nn/optim_pieces.py) in a 2-process gloo job: AdamW over a split, a
broadcast and a parameter only rank 1 holds (rank 0 steps it as empty placeholders, so its step count
advances as rank 1's), eagerly with a schedule and clipping, equals one device on every rank; no
global op is dispatched by the update; and the same under ``gt.compile`` with one capture."""
from __future__ import annotations

PROGRAM = r'''
import json
import torch
import globaltensor as gt

S, B = gt.sbp.split, gt.sbp.broadcast
both, one = gt.placement("cpu", [0, 1]), gt.placement("cpu", [1])
gen = torch.Generator().manual_seed(0)
values = [torch.randn(s, dtype=torch.float64, generator=gen) for s in [(7, 3), (5,), (4, 4)]]
layouts = [(both, S(0)), (both, B), (one, B)]
grads = [[torch.randn(v.shape, dtype=torch.float64, generator=gen) for v in values] for _ in range(4)]

def run(params, compiled):
    opt = torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
    def step(*gs):
        for p, g in zip(params, gs):
            p.grad = gt.distribute(g, p.placement, p.sbp) if isinstance(p, gt.GlobalTensor) else g.clone()
        torch.nn.utils.clip_grad_norm_(params[:2], 1.0)
        opt.step()
    g = gt.compile(step) if compiled else step
    for k in range(4):
        g(*grads[k])
        sched.step()
    return opt, (g.captures if compiled else None)

plain = [v.clone().requires_grad_() for v in values]
run(plain, False)
out = {"rank": gt.rank()}
for mode in ("eager", "compiled"):
    params = [gt.distribute(v.clone(), pl, sbp).requires_grad_() for v, (pl, sbp) in zip(values, layouts)]
    opt, captures = run(params, mode == "compiled")
    full = [p.full_tensor() for p in params]           # a collective: every rank
    out[mode] = {"diff": max((f - w.detach()).abs().max().item() for f, w in zip(full, plain)),
                 "steps": [opt.state[p]["step"].item() for p in params], "captures": captures}
    if mode == "eager":
        # the clipping's ops only: the update on pieces dispatches nothing
        params2 = [gt.distribute(v.clone(), pl, sbp).requires_grad_() for v, (pl, sbp) in zip(values, layouts)]
        for p, g in zip(params2, grads[0]):
            p.grad = gt.distribute(g, p.placement, p.sbp)
        opt2 = torch.optim.AdamW(params2, lr=0.05)
        opt2.step()
        before = gt.dispatch_cache_info()
        opt2.step()
        after = gt.dispatch_cache_info()
        out["dispatched_by_update"] = after.hits + after.misses - before.hits - before.misses
print("GT " + json.dumps(out))
'''


def test_adamw_on_pieces_in_two_processes_equals_one_device(launch):
    result = launch(PROGRAM, 2)
    records = result.one_record_each((0, 1))
    for rec in records:
        assert rec["dispatched_by_update"] == 0, rec
        for mode in ("eager", "compiled"):
            got = rec[mode]
            # 4 elementwise steps in float64 on pieces: a few ulps from one device (test_optim_pieces.py)
            assert got["diff"] < 1e-13, (mode, rec)
            assert got["steps"] == [4.0, 4.0, 4.0], (mode, rec)     # rank 0 advances the one it holds not
        assert rec["compiled"]["captures"] == 1, rec


WHOLE_PROGRAM = r'''
import json
import torch
import globaltensor as gt

S, B = gt.sbp.split, gt.sbp.broadcast
both = gt.placement("cpu", [0, 1])
gen = torch.Generator().manual_seed(0)
values = [torch.randn(s, dtype=torch.float64, generator=gen) for s in [(7, 4), (4, 6), (5, 3)]]
layouts = [S(0), S(1), B]
grads = [[torch.randn(v.shape, dtype=torch.float64, generator=gen) for v in values] for _ in range(4)]
out = {"rank": gt.rank()}
for name in ("Muon", "Adafactor"):
    def run(params, compiled):
        opt = getattr(torch.optim, name)(params, lr=0.05, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
        def step(*gs):
            for p, g in zip(params, gs):
                p.grad = gt.distribute(g, p.placement, p.sbp) if isinstance(p, gt.GlobalTensor) else g.clone()
            opt.step()
        f = gt.compile(step) if compiled else step
        for k in range(4):
            f(*grads[k])
            sched.step()
        return f.captures if compiled else None
    plain = [v.clone().requires_grad_() for v in values]
    run(plain, False)
    for mode in ("eager", "compiled"):
        params = [gt.distribute(v.clone(), both, sbp).requires_grad_() for v, sbp in zip(values, layouts)]
        captures = run(params, mode == "compiled")
        full = [p.full_tensor() for p in params]           # a collective: every rank
        out[f"{name} {mode}"] = {"diff": max((f - w.detach()).abs().max().item() for f, w in zip(full, plain)),
                                 "captures": captures}
print("GT " + json.dumps(out))
'''


def test_whole_tensor_optimizers_over_split_parameters_in_two_processes(launch):
    """Muon and Adafactor over parameters split on rows, on columns and broadcast: gathered whole, each
    process the whole update, its part written back -- equal to one device (the same kernels on the
    same values: exact), eagerly and under gt.compile with one capture under a cosine schedule."""
    result = launch(WHOLE_PROGRAM, 2)
    records = result.one_record_each((0, 1))
    for rec in records:
        for name in ("Muon", "Adafactor"):
            assert rec[f"{name} eager"]["diff"] == 0, rec
            assert rec[f"{name} compiled"]["diff"] == 0 and rec[f"{name} compiled"]["captures"] == 1, rec
