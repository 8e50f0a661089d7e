"""Expert parallelism: a mixture-of-experts GPT whose tokens travel to their experts' ranks.

    python examples/howto/expert_parallel.py [--tiny] [--steps N] [--float64]

The GPT of examples/gpt.py with ``n_experts=4``: each block's MLP is a top-2 router over 4 gated
experts, their weights stacked on a leading expert dim (as HuggingFace's MoE models keep them).
The plan splits those stacked weights over the experts -- one expert per rank -- and everything
else is data parallel, the batch split over the same 4 ranks. ``gt.nn.expert_parallel`` then
swaps each experts module's forward: each rank sends the tokens its router gives to another
rank's expert there (an all-to-all in the sizes the routing decides, after a small exchange of
the counts), runs its own expert on what it received, and gets the results back (the reverse
all-to-all); the backward retraces the same routes. No expert weight moves: the script prints
the bytes of one step's token all-to-alls beside the experts' weights, which stay put (without
``expert_parallel``, the same plan would gather every expert's weights to every rank).
"""
from __future__ import annotations

import dataclasses

import globaltensor as gt
import side_by_side as sbs  # puts examples/ on sys.path: gpt, demo

S, B = gt.sbp.split, gt.sbp.broadcast
EXPERTS = {"*.experts.gate_up_proj": S(0), "*.experts.down_proj": S(0)}   # experts split over the ranks


def run(argv=None) -> sbs.Result:
    args = sbs.parse_args(__doc__, argv)
    args.cfg = dataclasses.replace(args.cfg, n_experts=4, top_k=2)
    sbs.setup_world()
    placement = gt.placement("cpu", ranks=[0, 1, 2, 3])
    model, reference = sbs.models(args)
    gt.nn.distribute_module(model, placement, EXPERTS)
    expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    gt.nn.expert_parallel(model, placement)
    step = sbs.adamw_step(model)
    sbs.log(f"expert parallel on 4 ranks: {args.cfg.n_experts} experts, top-{args.cfg.top_k}, one expert per rank; "
            f"the batch split over the same ranks")
    sbs.describe(model, ["blocks.0.mlp.experts.gate_up_proj", "blocks.0.mlp.router.weight"])
    sbs.log(f"the experts' weights: {expert_bytes:,} bytes in all; expert parallelism moves none of them")

    def to_global(idx, targets):
        return gt.distribute(idx, placement, S(0)), gt.distribute(targets, placement, S(0))

    prof = sbs.profile_one_step(model, to_global, args)
    dispatch = sum(max(e.bytes_per_rank.values()) for e in prof.events if e.op == "expert dispatch")
    sbs.log(f"one forward and backward: the token all-to-alls sent {dispatch:,} bytes (the busiest rank, summed "
            f"over them), the whole step {prof.bytes_sent:,}")
    return sbs.train(model, reference, step, to_global, args)


if __name__ == "__main__":
    run()
