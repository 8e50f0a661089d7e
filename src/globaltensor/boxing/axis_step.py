"""One same-placement boxing step: change the SBP of a set of placement axes at once.

A step changes axes ``A`` (all holding one SBP ``x``) to ``y``. Each group of ranks along
``A`` then does a 1-D conversion of the region the other axes give it. That is exact only
when no axis outside ``A`` after the first of ``A`` splits a dim that ``x`` or ``y`` splits
(splits on one dim nest in axis order); :func:`is_clean` checks it.
"""
from __future__ import annotations

from functools import lru_cache
from itertools import combinations

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


@lru_cache(maxsize=65536)
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


@lru_cache(maxsize=16384)
def regroups(src: Layout, target: tuple) -> tuple:
    """All-to-alls straight from ``src`` to ``target`` over groups of axes, where valid.

    They move the intersecting blocks from the source pieces to the target pieces at once,
    e.g. (S0, S1) -> (S1, S0) in one exchange over all four ranks. The group's axes are the
    ones that change plus any subset of the unchanged ones; every one of them must split on
    both sides (so the members' blocks are disjoint: replication is left to all-gathers and
    reduction to reduce-scatters), and every target piece of a group must be covered by the
    group's source pieces.
    """
    changed = [a for a, (x, y) in enumerate(zip(src.nd_sbp, target)) if x != y]
    if not changed or not all(src.nd_sbp[a].is_split and target[a].is_split for a in changed):
        return ()
    extra = [a for a, v in enumerate(src.nd_sbp) if a not in changed and v.is_split]
    dst = src.with_sbp(target)
    out = []
    for k in range(len(extra) + 1):
        for more in combinations(extra, k):
            axes = tuple(sorted(changed + list(more)))
            groups = tuple(axis_groups(src.placement, axes))
            if _covers(src, dst, groups):
                sent = {}
                for g in groups:
                    sent.update(_group_bytes("all_to_all", src, dst, g))
                out.append(Step("all_to_all", src, dst, axes, groups, tuple(sorted(sent.items()))))
    return tuple(out)


def _covers(src: Layout, dst: Layout, groups: tuple) -> bool:
    for g in groups:
        for d in g:
            dbox = dst.box(d)
            got = 0
            for s in g:
                inter = intersect(src.box(s), dbox)
                if inter:
                    got += numel([l for _, l in inter])
            if got != numel([l for _, l in dbox]):
                return False
    return True


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
