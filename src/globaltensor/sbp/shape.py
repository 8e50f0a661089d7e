"""The shape algebra of balanced splits.

A dim of ``n`` over ``k`` ranks gives the first ``n % k`` ranks ``ceil(n/k)`` and the rest
``floor(n/k)``. Under an nd-SBP the axes that split the same dim cut it one after the
other, in axis order: axis 0 cuts the dim, axis 1 cuts each of those parts again, ...

A blocked split (``split(d, blocks=f)``) reads dim ``d`` of size ``n`` as the pair ``(f, n/f)``
and cuts the second: a rank's piece is its part of every block. Its pieces are not boxes of
the tensor but boxes of the *factored* tensor, whose dim ``d`` is that pair: plain splits of
``d`` on the same placement (on earlier axes) cut the blocks, ``f`` over their ranks, blocked
ones cut within them. A rank's piece is its factored box, read in row-major order.

A head-tail split (``split(d, order="head_tail")``, ``blocks=f`` allowed) cuts each block of dim ``d``
into ``2W`` balanced chunks; rank ``r`` of the axis holds chunks ``r`` and ``2W - 1 - r`` of every
block, side by side in that order. It is the only split of its dim. Its pieces are grids of
boxes, one *segment* list per dim (:func:`segments`): a dim's segments are the ranges of the
logical dim that the piece's dim holds, in order.
"""
from __future__ import annotations

from functools import lru_cache

from .values import broadcast, split


def balanced_sizes(n: int, k: int) -> tuple:
    """The part sizes of ``n`` split over ``k``: the first ``n % k`` get one more."""
    q, r = divmod(n, k)
    return tuple(q + 1 if i < r else q for i in range(k))


def balanced_range(n: int, k: int, i: int) -> tuple:
    """(start, length) of part ``i`` when ``n`` is split over ``k``."""
    q, r = divmod(n, k)
    return (i * q + min(i, r), q + 1 if i < r else q)


def blocked_dims(nd_sbp: tuple) -> dict:
    """``{dim: blocks}`` of the blocked splits in plain order in ``nd_sbp`` (empty for plain layouts)."""
    return {v.dim: v.blocks for v in nd_sbp if v.is_split and v.blocked}


def head_tail_axes(nd_sbp: tuple) -> dict:
    """``{dim: axis}`` of the head-tail splits in ``nd_sbp``."""
    return {v.dim: a for a, v in enumerate(nd_sbp) if v.is_split and v.head_tail}


def head_tail_problem(shape: tuple, nd_sbp: tuple):
    """Why ``nd_sbp``'s head-tail splits do not describe pieces of ``shape`` (a string), or None."""
    axes = head_tail_axes(nd_sbp)
    if not axes:
        return None
    if blocked_dims(nd_sbp):
        return f"a head-tail split and a blocked split in plain order in one layout: {nd_sbp!r}"
    for d, a in axes.items():
        if sum(v.is_split and v.dim == d for v in nd_sbp) > 1:
            return f"a head-tail split is the only split of its dim, but dim {d} is split more: {nd_sbp!r}"
        if shape[d] % nd_sbp[a].blocks:
            return f"dim {d} of size {shape[d]} does not hold {nd_sbp[a].blocks} equal blocks"
    return None


def blocks_problem(shape: tuple, hierarchy: tuple, nd_sbp: tuple, blocks: tuple = ()):
    """Why ``nd_sbp``'s blocked splits do not describe pieces of ``shape`` (a string), or None.

    Every blocked split of a dim has the same block count ``f``, which divides the dim; plain
    splits of that dim come on earlier axes and cut whole blocks (their ranks divide ``f``).
    ``blocks`` (``(dim, f)`` pairs) asks the same of dims to factor that ``nd_sbp`` does not
    block: whether :func:`factored` with them describes the same pieces."""
    problem = head_tail_problem(shape, nd_sbp)
    if problem or head_tail_axes(nd_sbp):
        return problem
    f_of = dict(blocks)
    f_of.update(blocked_dims(nd_sbp))
    for d, f in f_of.items():
        axes = [(a, v) for a, v in enumerate(nd_sbp) if v.is_split and v.dim == d]
        if any(v.blocks not in (1, f) for _, v in axes):
            return f"the splits of dim {d} have different block counts: {nd_sbp!r}"
        if shape[d] % f:
            return f"dim {d} of size {shape[d]} does not hold {f} equal blocks"
        plain = [a for a, v in axes if v.blocks == 1]
        if any(a > b for a in plain for b, v in axes if v.blocks > 1):
            return f"a plain split of dim {d} comes after its blocked split: {nd_sbp!r}"
        cut = numel(hierarchy[a] for a in plain)
        if f % cut:
            return f"the plain splits of dim {d} cut its {f} blocks over {cut} ranks"
    return None


@lru_cache(maxsize=4096)
def factored(shape: tuple, nd_sbp: tuple, blocks: tuple = ()) -> tuple:
    """``(shape, nd_sbp)`` of the factored tensor: each blocked dim ``d`` (``blocks`` adds
    ``(dim, f)`` pairs to factor though ``nd_sbp`` does not block them) becomes the pair
    ``(f, n/f)``, its plain splits cutting the first, its blocked splits the second."""
    if head_tail_axes(nd_sbp):
        raise ValueError(f"factored: the pieces of {nd_sbp!r} are no boxes of a factored tensor (a head-tail "
                         f"split holds two chunks of each block); use their segments")
    f_of = dict(blocks)
    f_of.update(blocked_dims(nd_sbp))
    where, out = {}, []
    for d, n in enumerate(shape):
        where[d] = len(out)
        out += [f_of[d], n // f_of[d]] if d in f_of else [n]
    nd = tuple(split(where[v.dim] + (v.blocks > 1)) if v.is_split else v for v in nd_sbp)
    return tuple(out), nd


@lru_cache(maxsize=65536)
def piece_ranges(shape: tuple, hierarchy: tuple, nd_sbp: tuple, coord: tuple, split_range=balanced_range) -> tuple:
    """(start, length) per tensor dim of the piece held at ``coord`` of the hierarchy; splits cut
    by ``split_range(n, k, i)`` (ours balanced; interop passes DTensor's chunk-style cut).
    Blocked and head-tail splits have no such box: ValueError (see :func:`factored`, :func:`segments`)."""
    if blocked_dims(nd_sbp) or head_tail_axes(nd_sbp):
        raise ValueError(f"piece_ranges: the pieces of {nd_sbp!r} are not boxes of the tensor (a blocked or "
                         f"head-tail split takes parts of the dim); use the factored layout or the segments")
    ranges = [(0, n) for n in shape]
    for axis, v in enumerate(nd_sbp):
        if v.is_split:
            start, length = ranges[v.dim]
            s, l = split_range(length, hierarchy[axis], coord[axis])
            ranges[v.dim] = (start + s, l)
    return tuple(ranges)


@lru_cache(maxsize=65536)
def segments(shape: tuple, hierarchy: tuple, nd_sbp: tuple, coord: tuple) -> tuple:
    """Per dim, the ``(start, length)`` ranges of the logical dim that the piece held at ``coord``
    holds along that dim, in the piece's order (empty ranges left out): one for a plain split,
    one per block for a blocked one, two per block for a head-tail one."""
    ht = head_tail_axes(nd_sbp)
    if ht:
        plain = tuple(v if not (v.is_split and v.head_tail) else broadcast for v in nd_sbp)
        out = [(r,) for r in piece_ranges(shape, hierarchy, plain, coord)]
        for d, a in ht.items():
            width, c, f = hierarchy[a], coord[a], nd_sbp[a].blocks
            size = shape[d] // f
            out[d] = tuple((b * size + start, length) for b in range(f)
                           for start, length in (balanced_range(size, 2 * width, c),
                                                 balanced_range(size, 2 * width, 2 * width - 1 - c)) if length)
        return tuple(out)
    f_of = blocked_dims(nd_sbp)
    if not f_of:
        return tuple((r,) for r in piece_ranges(shape, hierarchy, nd_sbp, coord))
    fshape, fnd = factored(shape, nd_sbp)
    fbox = iter(piece_ranges(fshape, hierarchy, fnd, coord))
    out = []
    for d in range(len(shape)):
        first = next(fbox)
        if d not in f_of:
            out.append((first,))
            continue
        (s, l), size = next(fbox), shape[d] // f_of[d]
        out.append(tuple((b * size + s, l) for b in range(first[0], first[0] + first[1]) if l))
    return tuple(out)


def piece_shape(shape: tuple, hierarchy: tuple, nd_sbp: tuple, coord: tuple) -> tuple:
    """The shape of the piece held at ``coord`` of the hierarchy."""
    if head_tail_axes(nd_sbp):
        return tuple(sum(l for _, l in segs) for segs in segments(shape, hierarchy, nd_sbp, coord))
    f_of = blocked_dims(nd_sbp)
    if not f_of:
        return tuple(l for _, l in piece_ranges(shape, hierarchy, nd_sbp, coord))
    fshape, fnd = factored(shape, nd_sbp)
    lengths = iter(l for _, l in piece_ranges(fshape, hierarchy, fnd, coord))
    return tuple(next(lengths) * next(lengths) if d in f_of else next(lengths) for d in range(len(shape)))


def piece_offset(shape: tuple, hierarchy: tuple, nd_sbp: tuple, coord: tuple) -> tuple:
    """Where the piece held at ``coord`` starts in the logical tensor, per dim."""
    return tuple(s for s, _ in piece_ranges(shape, hierarchy, nd_sbp, coord))


def numel(shape) -> int:
    """The number of elements of ``shape``."""
    n = 1
    for s in shape:
        n *= s
    return n


def contiguous_strides(shape) -> tuple:
    """The strides of a contiguous tensor of ``shape`` (a dim of size 0 counted as 1, as torch does)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(strides[::-1])


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
