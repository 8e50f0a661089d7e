"""DTensor's uneven split beside ours, and the point-to-point moves from one to the other (pure).

globaltensor splits ``n`` over ``k`` ranks *balanced* (the first ``n % k`` ranks get one more);
DTensor splits like ``torch.chunk`` (every rank ``ceil(n/k)`` until the rows run out, so the
last ranks get fewer, possibly none). Both cut a dim split by several placement axes one axis
after the other, in axis order. The two agree whenever ``k`` divides ``n`` and in some uneven
cases (7 over 4: 2 2 2 1); elsewhere (6 over 4: balanced 2 2 1 1, chunk 2 2 2 0) a few rows
must move: :func:`repartition_moves` lists exactly the overlaps between a rank's old and new
block, so a rank whose block is the same keeps its piece and sends nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import product

from ..sbp.shape import balanced_range, piece_ranges


def chunk_range(n: int, k: int, i: int) -> tuple:
    """(start, length) of part ``i`` when ``n`` is split over ``k`` as ``torch.chunk`` (DTensor) does."""
    size = -(-n // k)
    start = min(size * i, n)
    return start, max(0, min(n, start + size) - start)


SPLITTERS = {"balanced": balanced_range, "chunk": chunk_range}


def piece_box(shape: tuple, hierarchy: tuple, nd_sbp: tuple, coord: tuple, style: str) -> tuple:
    """(start, length) per tensor dim of the piece at ``coord``, splits cut in ``style``."""
    return piece_ranges(shape, hierarchy, nd_sbp, coord, SPLITTERS[style])


def layouts_agree(shape: tuple, hierarchy: tuple, nd_sbp: tuple) -> bool:
    """Whether every rank's piece is the same block under both split styles (no data moves)."""
    return all(piece_box(shape, hierarchy, nd_sbp, c, "balanced") == piece_box(shape, hierarchy, nd_sbp, c, "chunk")
               for c in product(*map(range, hierarchy)))


@dataclass(frozen=True)
class Move:
    """Rows ``src`` holds in its old piece that ``dst``'s new piece needs: ``region`` is the block in
    logical coordinates, ``(start, length)`` per dim."""
    src: tuple      # placement coordinate
    dst: tuple
    region: tuple


def _intersect(a: tuple, b: tuple):
    out = []
    for (s1, l1), (s2, l2) in zip(a, b):
        lo, hi = max(s1, s2), min(s1 + l1, s2 + l2)
        if hi <= lo:
            return None
        out.append((lo, hi - lo))
    return tuple(out)


@lru_cache(maxsize=1024)
def repartition_moves(shape: tuple, hierarchy: tuple, nd_sbp: tuple, src_style: str, dst_style: str) -> tuple:
    """The moves that turn pieces cut in ``src_style`` into pieces cut in ``dst_style``.

    A destination takes its rows only from sources with its own coordinate on every axis that
    does not split (broadcast: its own replica; partial-sum: its own addend), so each replica and
    each addend is repartitioned on its own and the value is unchanged. Moves with ``src == dst``
    are local copies; a destination whose block is unchanged has only that one move.
    """
    coords = list(product(*map(range, hierarchy)))
    split_axes = [a for a, v in enumerate(nd_sbp) if v.is_split]
    moves = []
    for dst in coords:
        want = piece_box(shape, hierarchy, nd_sbp, dst, dst_style)
        if any(l == 0 for _, l in want):
            continue
        for src in coords:
            if any(src[a] != dst[a] for a in range(len(hierarchy)) if a not in split_axes):
                continue
            region = _intersect(want, piece_box(shape, hierarchy, nd_sbp, src, src_style))
            if region is not None:
                moves.append(Move(src, dst, region))
    return tuple(moves)
