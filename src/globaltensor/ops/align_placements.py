"""Scalars from other placements, brought to the op's: the one place where an op takes global inputs
on several placements.

A pipeline's stages sit on placements of their own, and some values are about the whole model: the
total norm ``clip_grad_norm_`` stacks from each stage's gradient norms, a loss logged across
stages. Each is a 0-dim tensor, so moving it costs a few bytes. An op whose global inputs are on
different placements, where all but those of one placement are 0-dim, runs on that placement,
its 0-dim inputs from elsewhere first made broadcast there; when every input is 0-dim, on the union
of their ranks (a 1-D placement), where every rank then holds the result. Any other mix raises
(a tensor with data to move is moved by ``to_global``, where the bytes show).
"""
from __future__ import annotations

from typing import Optional

from ..placement import Placement
from ..sbp import broadcast
from ..tensor import GlobalTensor


def aligned_placement(func, tensors) -> Optional[Placement]:
    """None when the global inputs share one placement; else the placement the op runs on."""
    placements = []
    for t in tensors:
        if isinstance(t, GlobalTensor) and t.placement not in placements:
            placements.append(t.placement)
    if len(placements) < 2:
        return None
    wide = [p for p in placements if any(isinstance(t, GlobalTensor) and t.placement == p and t.dim() > 0
                                         for t in tensors)]
    if len(wide) > 1 or len({p.type for p in placements}) > 1:
        a, b = wide[:2] if len(wide) > 1 else placements[:2]
        i, j = (next(k for k, t in enumerate(tensors) if isinstance(t, GlobalTensor) and t.placement == p) for p in (a, b))
        raise ValueError(f"{func}: all global inputs must share one placement (only 0-dim tensors are brought from "
                         f"another of the same device type); tensor input {i} is on {a} but tensor input {j} is on "
                         f"{b}: move one with to_global(placement=...)")
    if wide:
        return wide[0]
    ranks = sorted({int(r) for p in placements for r in p.ranks.flatten()})
    return Placement(placements[0].type, ranks=ranks)


def run_aligned(func, placement: Placement, args, kwargs):
    """``func`` called again with every global input not on ``placement`` made broadcast there."""
    def moved(v):
        if isinstance(v, GlobalTensor) and v.placement != placement:
            return v.to_global(placement=placement, sbp=(broadcast,) * placement.ndim)
        if type(v) in (list, tuple):
            return type(v)(moved(x) for x in v)
        return v
    return func(*moved(args), **{k: moved(v) for k, v in kwargs.items()})
