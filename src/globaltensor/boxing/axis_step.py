"""One same-placement boxing step: change the SBP of a set of placement axes at once.

A step changes axes ``A`` (all holding one SBP ``x``) to ``y``. Each group of ranks along
``A`` then does a 1-D conversion of the region the other axes give it. That is exact only
when no axis outside ``A`` after the first of ``A`` splits a dim that ``x`` or ``y`` splits
(splits on one dim nest in axis order); :func:`is_clean` checks it.
"""
from __future__ import annotations

from ..comm.stats import ring_bytes
from ..sbp.shape import balanced_sizes, numel
from .layout import Layout, axis_groups, intersect
from .plan import Step


def is_clean(nd_sbp: tuple, axes: tuple, x, y) -> bool:
    first = min(axes)
    dims = {v.dim for v in (x, y) if v.is_split}
    return not any(v.is_split and v.dim in dims for b, v in enumerate(nd_sbp) if b > first and b not in axes)


def step_op(x, y) -> str:
    if x == y:
        return "none"
    if x.is_split:
        if y.is_split:
            return "all_to_all"
        return "all_gather" if y.is_broadcast else "to_partial"
    if x.is_broadcast:
        return "slice" if y.is_split else "to_partial"
    return "reduce_scatter" if y.is_split else "all_reduce"


def make_step(src: Layout, axes: tuple, y) -> Step:
    """The step setting ``axes`` of ``src`` to ``y``, with its exact bytes per rank."""
    x = src.nd_sbp[axes[0]]
    nd = list(src.nd_sbp)
    for a in axes:
        nd[a] = y
    dst = src.with_sbp(tuple(nd))
    op = step_op(x, y)
    groups = tuple(axis_groups(src.placement, axes))
    sent = {}
    if op in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
        for g in groups:
            sent.update(_group_bytes(op, src, dst, g))
    return Step(op, src, dst, tuple(axes), groups, tuple(sorted(sent.items())))


def _group_bytes(op: str, src: Layout, dst: Layout, group: tuple) -> dict:
    size = src.itemsize
    if op == "all_gather":
        return ring_bytes(group, [src.piece_bytes(r) for r in group])
    if op == "reduce_scatter":
        return ring_bytes(group, [dst.piece_bytes(r) for r in group])
    if op == "all_reduce":
        n = numel(src.piece_shape(group[0]))
        return {r: 2 * b for r, b in ring_bytes(group, [s * size for s in balanced_sizes(n, len(group))]).items()}
    out = {}
    for r in group:
        box = src.box(r)
        total = 0
        for q in group:
            if q != r:
                inter = intersect(box, dst.box(q))
                total += numel([l for _, l in inter]) * size if inter else 0
        out[r] = total
    return out
