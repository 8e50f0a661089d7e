"""Mixed precision: bfloat16 autocast and a GradScaler around a data-parallel step, with a fused AdamW.

    python examples/howto/mixed_precision.py [--tiny] [--steps N] [--float64]
    python -m globaltensor.launch --nproc-per-node 4 examples/howto/mixed_precision.py

The same ``torch.autocast`` / ``torch.amp.GradScaler`` code as on one device, unchanged: autocast
runs the matmuls in bfloat16 on each rank's rows, the scaler multiplies the loss before the
backward and divides the gradients after it -- each rank's pieces, in the fused optimizer's one
kernel call -- and skips the step on every rank when any rank's piece of any gradient holds an
inf or a NaN. The single-device reference runs the same code. In float64 autocast leaves the
ops alone (it lowers float32 only) and scaling by a power of two is exact, so ``--float64`` checks
the scaler's arithmetic against one device to the usual bound; in float32 the two runs differ by
bfloat16 rounding (~1e-2).
"""
from __future__ import annotations

import torch

import globaltensor as gt
import side_by_side as sbs  # puts examples/ on sys.path: gpt, demo

S = gt.sbp.split


def amp_step(model, opt, scaler):
    """One training step under autocast with loss scaling: the same function for both runs."""
    def step(idx, targets):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model.loss(idx, targets)
        scaler.scale(loss).backward()
        scaler.step(opt)                                   # unscales, checks every rank's pieces for infs
        scaler.update()
        opt.zero_grad()
        return loss
    return step


def fused_adamw(params):
    return torch.optim.AdamW(params, lr=sbs.LR, eps=sbs.EPS, fused=True)


def run(argv=None) -> sbs.Result:
    args = sbs.parse_args(__doc__, argv)
    sbs.setup_world()
    placement = gt.placement("cpu", ranks=[0, 1, 2, 3])
    model, reference = sbs.models(args)
    gt.nn.distribute_module(model, placement)              # data parallel: parameters replicated
    step = amp_step(model, fused_adamw(model.parameters()), torch.amp.GradScaler("cpu", init_scale=2.0 ** 10))
    reference_step = amp_step(reference, fused_adamw(reference.parameters()),
                              torch.amp.GradScaler("cpu", init_scale=2.0 ** 10))
    sbs.log("mixed precision on 4 ranks: bfloat16 autocast, GradScaler, fused AdamW; the batch split")

    def to_global(idx, targets):
        return gt.distribute(idx, placement, S(0)), gt.distribute(targets, placement, S(0))

    return sbs.train(model, reference, step, to_global, args, reference_step=reference_step,
                     float32_differs_by="bfloat16 rounding of sums taken in another order")


if __name__ == "__main__":
    run()
