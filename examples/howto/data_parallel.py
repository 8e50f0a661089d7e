"""Data parallel: every rank holds the whole model, the batch is split over the ranks.

    python examples/howto/data_parallel.py [--tiny] [--steps N] [--float64]
    python -m globaltensor.launch --nproc-per-node 4 examples/howto/data_parallel.py

The parameters are broadcast (``B``: replicated) on a 1-D placement of 4 ranks, the batch is
split along dim 0 (``S(0)``). Each op then runs on each rank's rows; the loss, a mean over the
batch, comes out partial (``P``), and so do the parameters' gradients. A gradient comes back in
its parameter's layout (``B``): the partial sums are all-reduced in buckets while the backward
runs, as DDP does, so the optimizer sees the same gradient on every rank and every rank applies
the same update.
"""
from __future__ import annotations

import globaltensor as gt
import side_by_side as sbs  # puts examples/ on sys.path: gpt, demo

S = gt.sbp.split


def run(argv=None) -> sbs.Result:
    args = sbs.parse_args(__doc__, argv)
    sbs.setup_world()
    placement = gt.placement("cpu", ranks=[0, 1, 2, 3])
    model, reference = sbs.models(args)
    gt.nn.distribute_module(model, placement)              # no plan: every parameter broadcast
    opt = sbs.adamw(model.parameters())
    sbs.log("data parallel on 4 ranks: parameters replicated, the batch split over the ranks")
    sbs.describe(model, ["blocks.0.attn.qkv.weight"])

    def step(idx, targets):
        loss = model.loss(idx, targets)
        loss.backward()                                    # gradients: all-reduced in buckets as they come
        opt.step()
        opt.zero_grad()
        return loss

    def to_global(idx, targets):                           # the whole batch, each rank keeps its rows
        return gt.distribute(idx, placement, S(0)), gt.distribute(targets, placement, S(0))

    return sbs.train(model, reference, step, to_global, args)


if __name__ == "__main__":
    run()
