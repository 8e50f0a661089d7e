"""Layouts: a logical tensor's global meta together with where and how its pieces lie."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import product

import torch

from ..placement import Placement
from ..sbp.shape import blocked_dims, factored, head_tail_axes, numel, piece_ranges, piece_shape, segments


@dataclass(frozen=True)
class Layout:
    shape: tuple
    dtype: torch.dtype
    placement: Placement
    nd_sbp: tuple

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash((self.shape, self.dtype, self.placement, self.nd_sbp)))
        object.__setattr__(self, "_shapes", {})     # rank -> piece shape: ops ask per call (views)
        object.__setattr__(self, "_boxes", {})
        # read on every gradient access and bucket hook: a plain attribute, not a generator per read
        object.__setattr__(self, "has_partial", any(v.is_partial for v in self.nd_sbp))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, Layout) and self._hash == other._hash and
                                 self.shape == other.shape and self.dtype == other.dtype and
                                 self.nd_sbp == other.nd_sbp and self.placement == other.placement)

    def box(self, rank: int) -> tuple:
        """(start, length) per dim of ``rank``'s piece."""
        box = self._boxes.get(rank)
        return box if box is not None else self._per_rank(self._boxes, piece_ranges, rank)

    def piece_shape(self, rank: int) -> tuple:
        shape = self._shapes.get(rank)
        return shape if shape is not None else self._per_rank(self._shapes, piece_shape, rank)

    def _per_rank(self, cache: dict, fn, rank: int) -> tuple:
        value = cache[rank] = fn(self.shape, self.placement.hierarchy, self.nd_sbp, self.placement.coord(rank))
        return value

    @property
    def blocked(self) -> bool:
        """Whether a split of this layout is blocked (its pieces are boxes of :meth:`factored` only)."""
        return bool(blocked_dims(self.nd_sbp))

    @property
    def head_tail(self) -> bool:
        """Whether a split of this layout is head-tail (its pieces are grids of boxes: :meth:`cells`)."""
        return bool(head_tail_axes(self.nd_sbp))

    def segments(self, rank: int, dim: int) -> tuple:
        """``(start in the tensor, start in the piece, length)`` of each range of dim ``dim`` that
        ``rank``'s piece holds, in order (sbp/shape.py ``segments``)."""
        out, offset = [], 0
        for start, length in segments(self.shape, self.placement.hierarchy, self.nd_sbp,
                                      self.placement.coord(rank))[dim]:
            out.append((start, offset, length))
            offset += length
        return tuple(out)

    def cells(self, rank: int) -> tuple:
        """``(box in the tensor, box in the piece)`` for each box of the tensor that ``rank``'s piece
        holds (sbp/shape.py ``segments``: the grid of each dim's ranges); one for a plain layout."""
        per_dim = [[((start, length), (at, length)) for start, at, length in self.segments(rank, d)]
                   for d in range(len(self.shape))]
        return tuple((tuple(g for g, _ in cell), tuple(p for _, p in cell)) for cell in product(*per_dim))

    def in_piece(self, rank: int, region: tuple) -> tuple:
        """Where ``region`` (a box of the tensor inside one of ``rank``'s :meth:`cells`) lies in the piece."""
        for whole, placed in self.cells(rank):
            if intersect(whole, region) == region:
                return tuple((p + s - w, l) for (s, l), (w, _), (p, _) in zip(region, whole, placed))
        raise ValueError(f"{region} is not inside one box of rank {rank}'s piece of {self.nd_sbp!r}")

    def factored(self, blocks: tuple = ()) -> "Layout":
        """The layout of the factored tensor (sbp/shape.py ``factored``): the same pieces, each
        reshaped, as boxes; ``blocks`` (``(dim, f)`` pairs) factors dims this layout does not block."""
        shape, nd = factored(self.shape, self.nd_sbp, blocks)
        return Layout(shape, self.dtype, self.placement, nd)

    def block_boxes(self, rank: int) -> list:
        """``(picks, box)`` for each box of the tensor that ``rank``'s piece covers: one, its
        :meth:`box`, with ``picks == ()``; for a blocked split, its part of each block, ``picks``
        giving ``(dim of the factored piece, index)`` of that block within the piece for each
        blocked dim, the last dim first (so selecting them in turn from the factored piece --
        ``self.factored().piece_shape(rank)`` -- leaves the part's view)."""
        if not self.blocked:
            return [((), self.box(rank))]
        blocked = sorted(blocked_dims(self.nd_sbp))
        factored = self.factored()
        fbox = factored.box(rank)
        where = [d + sum(b < d for b in blocked) for d in range(len(self.shape))]
        out = []
        for indices in product(*(range(fbox[where[d]][1]) for d in blocked)):
            pick = dict(zip(blocked, indices))
            box = tuple(((fbox[f][0] + pick[d]) * factored.shape[f + 1] + fbox[f + 1][0], fbox[f + 1][1])
                        if d in pick else fbox[f] for d, f in enumerate(where))
            out.append((tuple((where[d], pick[d]) for d in reversed(blocked)), box))
        return out

    def with_sbp(self, nd_sbp: tuple) -> "Layout":
        return Layout(self.shape, self.dtype, self.placement, tuple(nd_sbp))

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def piece_bytes(self, rank: int) -> int:
        return numel(self.piece_shape(rank)) * self.itemsize


@lru_cache(maxsize=4096)
def axis_groups(placement: Placement, axes: tuple) -> tuple:
    """The groups of ranks that vary along ``axes`` with the other coordinates fixed.

    Members of a group are in row-major order over ``axes``; groups are in row-major order
    over the other axes, so every process enumerates them identically.
    """
    ranks = placement.ranks
    others = [a for a in range(ranks.ndim) if a not in axes]
    groups = []
    for fixed in product(*(range(ranks.shape[a]) for a in others)):
        index = [slice(None)] * ranks.ndim
        for a, i in zip(others, fixed):
            index[a] = i
        sub = ranks[tuple(index)]
        groups.append(tuple(int(r) for r in sub.reshape(-1)))
    return tuple(groups)


def intersect(a: tuple, b: tuple):
    """Intersection of two boxes ((start, length) per dim), or None when it is empty."""
    out = []
    for (s1, l1), (s2, l2) in zip(a, b):
        s, e = max(s1, s2), min(s1 + l1, s2 + l2)
        if e <= s:
            return None
        out.append((s, e - s))
    return tuple(out)


def relative(inner: tuple, outer: tuple) -> tuple:
    """``inner`` expressed in the coordinates of ``outer``."""
    return tuple((s - so, l) for (s, l), (so, _) in zip(inner, outer))


def take(t: torch.Tensor, rel: tuple) -> torch.Tensor:
    """The sub-block ``rel`` ((start, length) per dim) of ``t``, as a view."""
    for d, (s, l) in enumerate(rel):
        if s != 0 or l != t.shape[d]:
            t = t.narrow(d, s, l)
    return t
