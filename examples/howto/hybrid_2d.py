"""2-D hybrid parallel: a 2x2 placement, data parallel on axis 0 and tensor parallel on axis 1.

    python examples/howto/hybrid_2d.py [--tiny] [--steps N] [--float64]

The placement ``[[0, 1], [2, 3]]`` has two axes. Every SBP is now a tuple, one entry per axis:
the Megatron plan on the tensor axis (``megatron_plan(..., axis=1, ndim=2)`` gives
``(B, S(0))`` for a column-parallel weight: replicated over the data axis, split over the tensor
axis) and the batch ``(S(0), B)``: split over the data axis, whole within a tensor-parallel pair.
The tensor-parallel all-reduces run within each row of the placement ({0, 1} and {2, 3}), the
data-parallel gradient all-reduces within each column ({0, 2} and {1, 3}). examples/demo.py is
this how-to with a compiled copy beside it.
"""
from __future__ import annotations

import globaltensor as gt
import side_by_side as sbs  # puts examples/ on sys.path: gpt, demo
from gpt import TENSOR_PARALLEL

S, B = gt.sbp.split, gt.sbp.broadcast
TENSOR_AXIS = 1                                              # axis 0 of the placement is the data axis


def run(argv=None) -> sbs.Result:
    args = sbs.parse_args(__doc__, argv)
    sbs.setup_world()
    placement = gt.placement("cpu", ranks=[[0, 1], [2, 3]])
    model, reference = sbs.models(args)
    plan = gt.nn.megatron_plan(**TENSOR_PARALLEL, axis=TENSOR_AXIS, ndim=2)
    gt.nn.distribute_module(model, placement, plan)
    step = sbs.adamw_step(model)
    sbs.log("2-D hybrid on a 2x2 placement: axis 0 data parallel, axis 1 tensor parallel")
    sbs.describe(model, ["blocks.0.attn.qkv.weight", "blocks.0.mlp.fc2.weight", "wte.weight"])
    if gt.rank() == 0:
        gt.visualize(model.blocks[0].attn.qkv.weight)      # which rank holds which block

    def to_global(idx, targets):
        batch_sbp = (S(0), B)                               # split over data, whole over tensor
        return gt.distribute(idx, placement, batch_sbp), gt.distribute(targets, placement, batch_sbp)

    return sbs.train(model, reference, step, to_global, args)


if __name__ == "__main__":
    run()
