"""Pipeline stages with ``gt.compile``: the first half of the GPT on ranks 0, 1, the second on ranks 2, 3.

    python examples/howto/pipeline.py [--tiny] [--steps N] [--float64] [--schedule 1f1b]

A stage is a placement: the embeddings and the first half of the blocks live on ``[0, 1]``, the
other blocks, the final layer norm and the head on ``[2, 3]`` (each stage data parallel inside:
its parameters replicated on its two ranks, the batch split). The forward moves the activations
from stage 1 to stage 2 with ``x.to_global(placement=stage2, sbp=S(0))`` -- a send/receive
between the ranks; autograd sends their gradient back. That already runs eagerly, one stage
after the other. ``gt.compile(step, micro_batches=4)`` captures the training step into a graph
for the actor runtime, splits each call's batch into 4 micro-batches and runs them in the order
of ``--schedule`` (default ``1f1b``: each stage starts a micro-batch's backward as soon as it can,
holding at most as many micro-batches as stages from it to the last; ``gpipe``: every forward,
then every backward; ``zero_bubble``): stage 2 works on micro-batch 0 while stage 1 computes
micro-batch 1; the gradients are averaged over the micro-batches and the optimizer steps once, so
the parameters equal those of the full-batch step. Call 1 runs eagerly (warm-up), call 2
captures, later calls run the graph.
"""
from __future__ import annotations

import torch.nn.functional as F

import globaltensor as gt
import side_by_side as sbs  # puts examples/ on sys.path: gpt, demo

S = gt.sbp.split
MICRO_BATCHES = 4


def run(argv=None) -> sbs.Result:
    args = sbs.parse_args(__doc__, argv, lambda parser: parser.add_argument(
        "--schedule", default="1f1b", choices=["gpipe", "1f1b", "zero_bubble"], help="the pipeline schedule"))
    sbs.setup_world()
    stage1 = gt.placement("cpu", ranks=[0, 1])
    stage2 = gt.placement("cpu", ranks=[2, 3])
    model, reference = sbs.models(args)
    half = args.cfg.n_layer // 2
    gt.nn.distribute_module(model, stage1)                  # everything on stage 1 first ...
    for part in [*model.blocks[half:], model.ln_f, model.lm_head]:
        gt.nn.distribute_module(part, stage2)               # ... then the second half moves to stage 2
    opt = sbs.adamw(model.parameters())
    sbs.log(f"pipeline: the embeddings and blocks[:{half}] on ranks [0, 1], blocks[{half}:] and the head on [2, 3], "
            f"{MICRO_BATCHES} micro-batches per step, schedule {args.schedule} (call 1 eager, call 2 captures, then "
            f"the graph)")
    sbs.describe(model, ["wte.weight", "lm_head.weight"])

    def forward(idx):
        x = model.wte(idx) + model.wpe(model.pos[:idx.shape[1]])
        for block in model.blocks[:half]:
            x = block(x)
        x = x.to_global(placement=stage2, sbp=S(0))         # stage 1 -> stage 2
        for block in model.blocks[half:]:
            x = block(x)
        return model.lm_head(model.ln_f(x))

    def train_step(idx, targets):
        logits = forward(idx)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    # in a simulated world every rank's tasks share this process's CPU: one compute and one
    # collective thread for all of them ("device" streams) run them faster than a thread per rank
    streams = "device" if gt.get_world().simulated else None
    step = gt.compile(train_step, micro_batches=MICRO_BATCHES, streams=streams, schedule=args.schedule)

    def to_global(idx, targets):                            # the tokens enter stage 1, the targets stage 2
        return gt.distribute(idx, stage1, S(0)), gt.distribute(targets, stage2, S(0))

    result = sbs.train(model, reference, step, to_global, args)
    plan = step.plan
    sbs.log(f"the graph (captured {step.captures} time): {len(plan.tasks)} tasks on {len(plan.streams)} streams, "
            f"{plan.micro_batches} micro-batches, {plan.pipeline or plan.schedule}; print(step.plan) lists them")
    return result


if __name__ == "__main__":
    run()
