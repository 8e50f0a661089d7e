"""The shape algebra of balanced splits.

A dim of ``n`` over ``k`` ranks gives the first ``n % k`` ranks ``ceil(n/k)`` and the rest
``floor(n/k)``. Under an nd-SBP the axes that split the same dim cut it one after the
other, in axis order: axis 0 cuts the dim, axis 1 cuts each of those parts again, ...
"""
from __future__ import annotations

from functools import lru_cache


def balanced_sizes(n: int, k: int) -> tuple:
    """The part sizes of ``n`` split over ``k``: the first ``n % k`` get one more."""
    q, r = divmod(n, k)
    return tuple(q + 1 if i < r else q for i in range(k))


def balanced_range(n: int, k: int, i: int) -> tuple:
    """(start, length) of part ``i`` when ``n`` is split over ``k``."""
    q, r = divmod(n, k)
    return (i * q + min(i, r), q + 1 if i < r else q)


@lru_cache(maxsize=65536)
def piece_ranges(shape: tuple, hierarchy: tuple, nd_sbp: tuple, coord: tuple, split_range=balanced_range) -> tuple:
    """(start, length) per tensor dim of the piece held at ``coord`` of the hierarchy; splits cut
    by ``split_range(n, k, i)`` (ours balanced; interop passes DTensor's chunk-style cut)."""
    ranges = [(0, n) for n in shape]
    for axis, v in enumerate(nd_sbp):
        if v.is_split:
            start, length = ranges[v.dim]
            s, l = split_range(length, hierarchy[axis], coord[axis])
            ranges[v.dim] = (start + s, l)
    return tuple(ranges)


def piece_shape(shape: tuple, hierarchy: tuple, nd_sbp: tuple, coord: tuple) -> tuple:
    """The shape of the piece held at ``coord`` of the hierarchy."""
    return tuple(l for _, l in piece_ranges(shape, hierarchy, nd_sbp, coord))


def piece_offset(shape: tuple, hierarchy: tuple, nd_sbp: tuple, coord: tuple) -> tuple:
    """Where the piece held at ``coord`` starts in the logical tensor, per dim."""
    return tuple(s for s, _ in piece_ranges(shape, hierarchy, nd_sbp, coord))


def numel(shape) -> int:
    """The number of elements of ``shape``."""
    n = 1
    for s in shape:
        n *= s
    return n


def broadcast_shape(*shapes) -> tuple:
    """The shape ``shapes`` broadcast to, by torch's rules (sizes of 1 stretch, dims align on
    the right); a ValueError when two sizes clash. Plain Python: ``torch.broadcast_shapes``
    takes tens of microseconds, which a new shape's first op would pay several times."""
    out = [1] * max(map(len, shapes), default=0)
    for shape in shapes:
        for i, n in enumerate(shape, len(out) - len(shape)):
            if n != 1:
                if out[i] != 1 and out[i] != n:
                    raise ValueError(f"shapes {[tuple(s) for s in shapes]} do not broadcast: "
                                     f"sizes {out[i]} and {n} meet at dim {i}")
                out[i] = n
    return tuple(out)
