"""FSDP-style parameters: every parameter split over the data axis, gathered where an op needs it whole.

    python examples/howto/fsdp.py [--tiny] [--steps N] [--float64]

The plan splits every weight and bias along its first dim (``S(0)``) over the 4 ranks, and the
batch too. Nothing else changes: when an op meets a split parameter and a split batch, the
signature it chooses decides what moves -- for a linear layer the cheapest is to all-gather the
weight (the batch stays split); for the embedding, whose table is split along the vocabulary, it
is to gather the (small) token ids instead, look each rank's rows up and keep the output a partial
sum. The backward gathers again where it needs the weight, and each gradient comes back in
its parameter's layout, ``S(0)``: a partial-sum gradient is reduce-scattered instead of DDP's
all-reduce. AdamW then updates each rank's shard only, so parameters, gradients and optimizer
state are all split (ZeRO stage 3, FSDP's FULL_SHARD).
"""
from __future__ import annotations

from collections import Counter

import torch

import globaltensor as gt
import side_by_side as sbs  # puts examples/ on sys.path: gpt, demo
from gpt import make_batch

S = gt.sbp.split
PLAN = {"*.weight": S(0), "*.bias": S(0)}                    # every parameter (the ``pos`` buffer stays B)


def run(argv=None) -> sbs.Result:
    args = sbs.parse_args(__doc__, argv)
    sbs.setup_world()
    placement = gt.placement("cpu", ranks=[0, 1, 2, 3])
    model, reference = sbs.models(args)
    gt.nn.distribute_module(model, placement, PLAN)
    opt = sbs.adamw(model.parameters())                     # its state is split like the parameters
    sbs.log("FSDP-style on 4 ranks: every parameter split over the ranks, the batch too")
    sbs.describe(model, ["wte.weight", "blocks.0.mlp.fc1.weight", "blocks.0.ln1.weight"])

    def step(idx, targets):
        loss = model.loss(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    def to_global(idx, targets):
        return gt.distribute(idx, placement, S(0)), gt.distribute(targets, placement, S(0))

    result = sbs.train(model, reference, step, to_global, args)
    idx, targets = to_global(*make_batch(args.cfg, args.batch, args.seq, torch.Generator().manual_seed(0)))
    with gt.comm_stats() as stats:
        model.loss(idx, targets).backward()
    opt.zero_grad()
    sbs.log("collectives of one forward and backward: "
            + ", ".join(f"{op} x{n}" for op, n in sorted(Counter(stats.ops()).items())))
    return result


if __name__ == "__main__":
    run()
