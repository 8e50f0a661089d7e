"""``gt.nn.predict_step``: the predicted step of a model as it is laid out now -- by a hand plan,
``distribute_module``, ``pipeline_stages`` -- rather than as ``auto_plan`` would lay it out.

    gt.nn.pipeline_stages(model, [gt.placement("cpu", [0]), gt.placement("cpu", [1])])
    idx, targets = gt.distribute(idx, stage0, S(0)), gt.distribute(targets, stage1, S(0))
    print(gt.nn.predict_step(model, (idx, targets), step=lambda m, i, t: m.loss(i, t).backward()).table())

The step runs once on meta twins of the model's parameters and buffers, each in its own layout,
and of the example arguments, in theirs (cost.py), and is predicted as ``plan.predict()`` predicts
(predict.py). Where the parameters sit on disjoint placements -- pipeline stages, in the order the
model holds them -- the step is eager pipelining: a stage waits for the one before it, so the
stages' times add up.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from ...comm import get_world
from ...tensor import GlobalTensor
from .calibration import current_calibration
from .cost import NeedsHostReads, evaluate_layouts
from .devices import device_named
from .plan import default_step, state_factor
from .predict import Prediction, predict_cost


def predict_step(model: nn.Module, example_args: Sequence, step: Optional[Callable] = None, *, optimizer=None,
                 device=None, tokens: Optional[int] = None) -> Prediction:
    """The predicted step of ``model`` laid out as it is, on ``example_args`` (global tensors, in the
    layouts the step takes them): ``step(model, *args)`` (default: the output summed, backward),
    ``optimizer`` (its class: its state's size; default Adam's), ``device`` (a ``gt.nn.Device``, a
    name of ``gt.nn.DEVICES``, or None: this machine as ``gt.calibrate()`` measured it), ``tokens``
    (default: the elements of the first integer argument)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"predict_step(model): expected an nn.Module, got {type(model).__name__}")
    layouts: Dict[str, tuple] = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if not isinstance(t, GlobalTensor):
            raise TypeError(f"predict_step(model): expected every parameter and buffer global (lay the model out "
                            f"first: gt.nn.distribute_module), got a plain {name} of shape {tuple(t.shape)}")
        layouts[name] = (t._layout.placement, t._layout.nd_sbp)
    args = []
    for i, a in enumerate(example_args):
        if not isinstance(a, GlobalTensor):
            raise TypeError(f"predict_step(example_args): expected global tensors (their layouts are the step's), "
                            f"got {type(a).__name__} at position {i}")
        args.append((tuple(a.shape), a.dtype, a._layout.placement, a._layout.nd_sbp))
    cal = current_calibration()
    target = device_named(device) or cal.device
    stages = pipeline_stages_of(model)
    try:
        cost = evaluate_layouts(model, get_world().size, layouts, args, step or default_step, None,
                                state_factor(optimizer), cal, device=target, stages=stages)
    except NeedsHostReads as needed:
        raise ValueError(f"predict_step: the step reads a tensor's value on the host at {needed.where}; a "
                         f"prediction runs it on shapes alone, with no values to read") from None
    ranks = sorted(cost.memory_by_rank)
    if tokens is None:
        tokens = next((a.numel() for a in example_args if not a.dtype.is_floating_point), None)
    dtype = next((t.dtype for t in model.parameters() if t.is_floating_point()), torch.float32)
    return predict_cost(cost, ranks, target, cal.host, tokens, cost.tally.model_flops, dtype, stages)


def pipeline_stages_of(model: nn.Module) -> Optional[List[List[int]]]:
    """The ranks of the model's pipeline stages, in the order it holds their parameters, where its
    parameters sit on two or more placements of disjoint ranks; else None."""
    stages: List[List[int]] = []
    for t in model.parameters():
        ranks = t._layout.placement.rank_list()
        if ranks in stages:
            continue
        if any(set(ranks) & set(s) for s in stages):
            return None
        stages.append(ranks)
    return stages if len(stages) > 1 else None
