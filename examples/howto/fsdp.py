"""FSDP-style parameters: the parameters split over the data axis, gathered where an op needs them whole.

    python examples/howto/fsdp.py [--tiny] [--steps N] [--float64]

The plan splits every weight and bias of the blocks and the head along its first dim (``S(0)``)
over the 4 ranks, and the batch too. Nothing else changes: when a linear layer meets a split
batch and a split weight, the cheapest signature all-gathers the weight and keeps the batch split
-- FSDP's unshard, found by the op. The backward gathers again where it needs a weight, and each
gradient comes back in its parameter's layout, ``S(0)``: a partial-sum gradient is
reduce-scattered instead of DDP's all-reduce. AdamW then updates each rank's shard only, so
parameters, gradients and optimizer state are split (ZeRO stage 3, FSDP's FULL_SHARD).

The embedding tables stay replicated. Layouts propagate: split along the vocabulary, the token
embedding's cheapest signature gathers the (small) token ids instead of the table and gives a
partial sum, and from there every rank would compute the whole batch -- tensor parallelism, not
data parallelism. Each op picks the cheapest signature for itself; a layout you want kept is
one you choose.
"""
from __future__ import annotations

from collections import Counter

import torch

import globaltensor as gt
import side_by_side as sbs  # puts examples/ on sys.path: gpt, demo
from gpt import make_batch

S, B = gt.sbp.split, gt.sbp.broadcast
# the first matching pattern decides: the embedding tables replicated, every other parameter split
PLAN = {"wte.weight": B, "wpe.weight": B, "*.weight": S(0), "*.bias": S(0)}


def run(argv=None) -> sbs.Result:
    args = sbs.parse_args(__doc__, argv)
    sbs.setup_world()
    placement = gt.placement("cpu", ranks=[0, 1, 2, 3])
    model, reference = sbs.models(args)
    gt.nn.distribute_module(model, placement, PLAN)
    opt = sbs.adamw(model.parameters())                     # its state is split like the parameters
    sbs.log("FSDP-style on 4 ranks: the parameters split over the ranks (the embedding tables replicated), "
            "the batch too")
    sbs.describe(model, ["wte.weight", "blocks.0.mlp.fc1.weight", "blocks.0.ln1.weight", "lm_head.weight"])

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
    with gt.comm_stats() as forward:
        loss = model.loss(idx, targets)
    with gt.comm_stats() as backward:
        loss.backward()
        [p.grad for p in model.parameters()]                # reading a gradient boxes it to its parameter's layout
    opt.zero_grad()
    for name, stats in (("forward", forward), ("backward", backward)):
        sbs.log(f"collectives of the {name}: {stats.bytes_sent:,} bytes, "
                + ", ".join(f"{op} x{n}" for op, n in sorted(Counter(stats.ops()).items())))
    return result


if __name__ == "__main__":
    run()
