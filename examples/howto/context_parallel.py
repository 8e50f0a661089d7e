"""Long context: a GPT whose sequences are split over the ranks, attention run as ring attention.

    python examples/howto/context_parallel.py [--tiny] [--steps N] [--float64]

Few, long sequences: 2 of them, each cut in 8 chunks along the tokens, rank r holding chunks r and
7 - r (the balanced causal split, ``S(1, order="head_tail")``: under the causal mask the late tokens
see more keys, and pairing an early chunk with a late one gives every rank the same attention
work; plain ``S(1)`` would give rank 3 several times rank 0's). The model is replicated (its
gradients summed over the ranks, as data parallelism sums them over the batch).
Everything row-wise -- embeddings, norms, the MLP, the loss -- runs on each rank's tokens. Attention
is where the ranks meet, and with 2 heads on 4 ranks there is no head split to turn to (Ulysses);
the dispatcher runs it as ring attention: each rank keeps its queries and passes its key/value
block around the ranks, merging partial results by their log-sum-exp; causal blocks a rank never
sees are skipped. No rank ever holds a whole sequence's keys and values. The script prints one
step's collectives: the ring's point-to-point blocks, the loss's one scalar, the gradients' bucket.
"""
from __future__ import annotations

import dataclasses

import globaltensor as gt
import side_by_side as sbs  # puts examples/ on sys.path: gpt, demo

S = gt.sbp.split
SEQ = S(1, order="head_tail")     # the balanced causal split: rank r holds chunks r and 7 - r of 8


def run(argv=None) -> sbs.Result:
    args = sbs.parse_args(__doc__, argv)
    args.seq = 4 * args.seq                                 # long sequences ...
    args.batch = 2                                          # ... and few of them
    args.cfg = dataclasses.replace(args.cfg, n_head=2, block_size=args.seq)
    sbs.setup_world()
    placement = gt.placement("cpu", ranks=[0, 1, 2, 3])
    model, reference = sbs.models(args)
    gt.nn.distribute_module(model, placement)               # replicated; gradients summed over the ranks
    step = sbs.adamw_step(model)
    sbs.log(f"context parallel on 4 ranks: {args.batch} sequences of {args.seq} tokens, a quarter of each per rank; "
            f"{args.cfg.n_head} heads")

    def to_global(idx, targets):
        return gt.distribute(idx, placement, SEQ), gt.distribute(targets, placement, SEQ)

    prof = sbs.profile_one_step(model, to_global, args)
    ring = sum(max(e.bytes_per_rank.values()) for e in prof.events if e.collective == "send_recv")
    others = sorted({(e.collective, e.op) for e in prof.events if e.collective != "send_recv"})
    sbs.log(f"one forward and backward: ring attention's key/value blocks {ring:,} bytes (the busiest rank); "
            f"besides: {', '.join(f'{c} ({op})' for c, op in others)}")
    return sbs.train(model, reference, step, to_global, args)


if __name__ == "__main__":
    run()
