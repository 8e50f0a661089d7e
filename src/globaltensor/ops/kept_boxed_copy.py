"""A boxed copy kept on the tensor it was made from, for the backward pass to use again.

Autograd saves an op's inputs for its backward. When an input had to be boxed for the
forward -- a row-parallel layer's partial output all-reduced for ``mse_loss`` or
``layer_norm`` -- the backward would box the saved input again: the same collective twice.
So the latest boxed copy of a tensor autograd may save (one that requires grad and has a
``grad_fn``) stays on it with the versions it was made at, and later ops box from it while
the tensor is unchanged; the dispatcher's cost model counts that conversion from the copy.

A partial tensor keeps its reduced copy too while grad mode is off, as it is in the backward
pass: there a partial gradient (the input gradient of a column-parallel layer) is read by
every op of the norm's backward before it; reduced once, each of them reads the copy.

Leaves (parameters) keep no copy: a gathered copy of a sharded parameter would live as long
as the parameter. An activation's copy lives as long as the activation, that is until the
backward has used it.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..boxing import Layout, plan_boxing
from ..tensor import GlobalTensor, box


class BoxedCopy(NamedTuple):
    layout: Layout
    versions: tuple
    tensor: GlobalTensor


def _versions(t: GlobalTensor) -> tuple:
    """The wrapper's version and its pieces' (a piece written through ``to_local()`` counts)."""
    return (t._version, tuple(p._version for p in t._pieces.values()))


def copy_layout(t: GlobalTensor) -> Optional[Layout]:
    """The layout of ``t``'s kept copy, if it has one (a stale one too: it is dropped when used)."""
    kept = t._boxed
    return None if kept is None else kept.layout


def box_input(t: GlobalTensor, target: Layout) -> GlobalTensor:
    """``t`` boxed to ``target``: from its kept copy when that is current and no dearer a start;
    the result is kept on ``t`` when autograd may save ``t``."""
    kept = t._boxed
    if kept is not None:
        if kept.versions != _versions(t):
            t._boxed = kept = None
        elif plan_boxing(kept.layout, target).bytes <= plan_boxing(t._layout, target).bytes:
            return kept.tensor if kept.layout == target else box(kept.tensor, target)
    out = box(t, target)
    if (t.requires_grad and t.grad_fn is not None) or (t._layout.has_partial and not torch.is_grad_enabled()):
        t._boxed = BoxedCopy(target, _versions(t), out)
    return out
