"""Tensor parallel (Megatron): each linear layer's weight is split over the ranks, the batch is whole.

    python examples/howto/tensor_parallel.py [--tiny] [--steps N] [--float64]

``gt.nn.megatron_plan`` turns the GPT's list of column- and row-parallel layers
(``gpt.TENSOR_PARALLEL``) into a plan, ``{parameter-name pattern: sbp}``: attention's qkv and the
MLP's fc1 are column parallel (weight ``[out, in]`` split on ``out``: ``S(0)``), attention's proj
and the MLP's fc2 row parallel (``S(1)``). Everything else (embeddings, layer norms, the head) is
replicated. No layer says how to communicate: the column-parallel output is split on its last
dim, the row-parallel matmul of that split input gives a partial sum, and the residual add that
needs the whole value all-reduces it -- one all-reduce per pair in the forward, as in
Megatron-LM. (The backward's collectives are what its ops' signatures choose, by bytes.) The qkv
output features are laid out head-major, so each rank gets whole heads.
"""
from __future__ import annotations

import globaltensor as gt
import side_by_side as sbs  # puts examples/ on sys.path: gpt, demo
from gpt import TENSOR_PARALLEL

B = gt.sbp.broadcast


def run(argv=None) -> sbs.Result:
    args = sbs.parse_args(__doc__, argv)
    sbs.setup_world()
    placement = gt.placement("cpu", ranks=[0, 1, 2, 3])
    model, reference = sbs.models(args)
    plan = gt.nn.megatron_plan(**TENSOR_PARALLEL)          # {"*.attn.qkv.weight": S(0), ...}
    gt.nn.distribute_module(model, placement, plan)
    step = sbs.adamw_step(model)                            # AdamW's state laid out like each parameter
    sbs.log("tensor parallel on 4 ranks, the plan:")
    for pattern, sbp in plan.items():
        sbs.log(f"  {pattern:22s} {sbp}")
    sbs.describe(model, ["blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight", "blocks.0.mlp.fc1.bias"])

    def to_global(idx, targets):                            # every rank sees the whole batch
        return gt.distribute(idx, placement, B), gt.distribute(targets, placement, B)

    return sbs.train(model, reference, step, to_global, args)


if __name__ == "__main__":
    run()
