"""Loss parallel: the logits stay split over the vocabulary through the cross-entropy.

    python examples/howto/loss_parallel.py [--tiny] [--steps N] [--float64]

On top of the Megatron plan of tensor_parallel.py, the head ``lm_head`` is column parallel too:
its weight ``[vocab, n_embd]`` is split over the vocabulary (``S(0)``), so the logits come out
split on their last dim, the vocabulary. The model's plain ``F.cross_entropy`` then runs on
those split logits: the softmax rule takes the row maxima and row sums of each rank's classes
and reduces only those (a few numbers per token), and the target's logit is picked where it
lives. The ``[tokens, vocab]`` logits -- the largest activation of a language model -- never
move, in the forward or in the backward. No loss-parallel context manager is needed: it is just
the signature the cross-entropy picks for split logits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import globaltensor as gt
import side_by_side as sbs  # puts examples/ on sys.path: gpt, demo
from gpt import TENSOR_PARALLEL, make_batch

S, B = gt.sbp.split, gt.sbp.broadcast


def run(argv=None) -> sbs.Result:
    args = sbs.parse_args(__doc__, argv)
    sbs.setup_world()
    placement = gt.placement("cpu", ranks=[0, 1, 2, 3])
    model, reference = sbs.models(args)
    plan = gt.nn.megatron_plan(**TENSOR_PARALLEL, extra={"lm_head.weight": S(0)})   # vocab-split head
    gt.nn.distribute_module(model, placement, plan)
    step = sbs.adamw_step(model)
    sbs.log("loss parallel on 4 ranks: Megatron plan plus a vocabulary-split head")
    sbs.describe(model, ["lm_head.weight"])

    def to_global(idx, targets):
        return gt.distribute(idx, placement, B), gt.distribute(targets, placement, B)

    idx, targets = to_global(*make_batch(args.cfg, args.batch, args.seq, torch.Generator().manual_seed(0)))
    logits = model(idx).reshape(-1, args.cfg.vocab_size)         # as in model.loss, autograd recording
    with gt.comm_stats() as stats:
        F.cross_entropy(logits, targets.reshape(-1))
    gather = gt.boxing_plan(logits, sbp=B)
    sbs.log(f"logits {tuple(logits.shape)} sbp {logits.sbp}: the cross-entropy sent {stats.bytes_sent:,} bytes "
            f"({', '.join(stats.ops())}); gathering the logits first would send {gather.bytes:,}")

    return sbs.train(model, reference, step, to_global, args)


if __name__ == "__main__":
    run()
