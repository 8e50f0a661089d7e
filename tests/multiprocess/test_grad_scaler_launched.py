"""GradScaler in a 2-process gloo job: an inf in the gradient piece of one rank only makes every rank
skip the step and halve its scale (found_inf is agreed over the gradients' ranks), and a fused AdamW
step over split parameters equals one device on every rank."""
from __future__ import annotations

PROGRAM = r'''
import json
import torch
import globaltensor as gt

torch.manual_seed(0)
p = gt.placement("cpu", [0, 1])
S, B = gt.sbp.split, gt.sbp.broadcast
w0 = torch.randn(6, 4, dtype=torch.float64)
grads = [torch.randn(6, 4, dtype=torch.float64) * 1024 for _ in range(3)]
grads[1][5, 0] = float("inf")                       # row 5: rank 1's piece only

def run(w):
    opt = torch.optim.AdamW([w], lr=0.05, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scales = []
    for g in grads:
        opt.zero_grad()
        scaler.scale(torch.zeros(()))
        w.grad = gt.distribute(g.clone(), p, S(0)) if isinstance(w, gt.GlobalTensor) else g.clone()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales

plain = w0.clone().requires_grad_()
want_scales = run(plain)
w = gt.distribute(w0.clone(), p, S(0)).requires_grad_()
scales = run(w)
diff = (w.full_tensor() - plain.detach()).abs().max().item()
print("GT " + json.dumps({"rank": gt.rank(), "scales": scales, "want": want_scales, "diff": diff}))
'''


def test_every_rank_skips_on_an_inf_in_one_ranks_piece(launch):
    result = launch(PROGRAM, 2)
    records = result.one_record_each((0, 1))
    for rec in records:
        assert rec["scales"] == rec["want"] == [1024.0, 512.0, 512.0], rec
        assert rec["diff"] < 1e-13, rec            # the fused kernel on pieces: a few ulps (test_fused_optimizers)
