"""ZeRO-style optimizer states: data parallel, with the optimizer's state and update split over the ranks.

    python examples/howto/zero_optimizer.py [--tiny] [--steps N] [--float64]

The model is laid out as in data_parallel.py (parameters ``B``, batch ``S(0)``), but the
optimizer is ``gt.nn.ZeroOptimizer(params, torch.optim.AdamW, axis=0, ...)``: the gradients
(partial sums over the data axis) are reduce-scattered straight to a shard per rank, AdamW
updates only that shard -- so its moments ``exp_avg`` and ``exp_avg_sq`` are split over the ranks,
a quarter each -- and the updated shards are all-gathered back into the replicated parameters.
Reduce-scatter plus all-gather send the bytes of the all-reduce they replace. It is a
``torch.optim.Optimizer``: LR schedulers, ``state_dict()`` and hooks work as usual.
"""
from __future__ import annotations

import torch

import globaltensor as gt
import side_by_side as sbs  # puts examples/ on sys.path: gpt, demo
from demo import EPS, LR

S = gt.sbp.split
DATA_AXIS = 0


def run(argv=None) -> sbs.Result:
    args = sbs.parse_args(__doc__, argv)
    sbs.setup_world()
    placement = gt.placement("cpu", ranks=[0, 1, 2, 3])
    model, reference = sbs.models(args)
    gt.nn.distribute_module(model, placement)              # parameters replicated, as in data parallel
    opt = gt.nn.ZeroOptimizer(model.parameters(), torch.optim.AdamW, axis=DATA_AXIS, lr=LR, eps=EPS)
    sbs.log("ZeRO on 4 ranks: parameters replicated, AdamW's state and update split over the ranks")

    def step(idx, targets):
        loss = model.loss(idx, targets)
        loss.backward()
        opt.step()              # reduce-scatter the gradients, update the shards, all-gather them back
        opt.zero_grad()
        return loss

    def to_global(idx, targets):
        return gt.distribute(idx, placement, S(0)), gt.distribute(targets, placement, S(0))

    result = sbs.train(model, reference, step, to_global, args)
    w = model.blocks[0].mlp.fc1.weight
    moment = opt.state[w]["exp_avg"]
    sbs.log(f"blocks.0.mlp.fc1.weight {tuple(w.shape)} sbp {w.sbp}; its AdamW exp_avg sbp {moment.sbp}, "
            f"rank 0 holds {tuple(moment.to_local(rank=0).shape)}")
    return result


if __name__ == "__main__":
    run()
