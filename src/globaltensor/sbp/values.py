"""SBP values: how a logical tensor relates to the piece one rank holds along one placement axis.

``split(d)``: the tensor is cut along dim ``d`` into balanced parts, one per rank of the axis.
``split(d, blocks=f)``: dim ``d`` is ``f`` equal blocks laid side by side (a fused ``[q | k | v]``
weight, or the ``(batch, heads)`` pair a view merged into one dim) and every block is cut into
balanced parts; a rank holds its part of each block, in block order.
``broadcast``: every rank holds the whole tensor.
``partial_sum``: every rank holds a tensor of the full shape; the logical tensor is their sum.
"""
from __future__ import annotations

import numbers
from dataclasses import FrozenInstanceError


class SbpValue:
    """Base of the three SBP kinds; instances are immutable and hashable.

    (Hand-written rather than ``@dataclass(frozen=True, slots=True)``: on Python < 3.12 that
    combination's ``__setattr__`` raises a confusing ``TypeError`` from ``super()`` instead of
    ``FrozenInstanceError`` for attributes that are not fields.)
    """

    __slots__ = ()
    is_split = False
    is_broadcast = False
    is_partial = False

    def __setattr__(self, name, value):
        raise FrozenInstanceError(f"cannot assign to field {name!r}: SBP values are immutable")

    def __delattr__(self, name):
        raise FrozenInstanceError(f"cannot delete field {name!r}: SBP values are immutable")

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


class Split(SbpValue):
    """``split(dim)``: each rank of the axis holds a balanced slice along ``dim``; with ``blocks=f``
    > 1, its balanced slice of each of the ``f`` equal blocks of ``dim``, the slices in block order."""
    __slots__ = ("dim", "blocks")
    is_split = True

    def __init__(self, dim: int, blocks: int = 1):
        if not isinstance(dim, numbers.Integral) or isinstance(dim, bool):
            raise TypeError(f"split(dim): expected an int dim, got {dim!r}")
        if not isinstance(blocks, numbers.Integral) or isinstance(blocks, bool) or blocks < 1:
            raise TypeError(f"split(dim, blocks): expected blocks to be an int >= 1, got {blocks!r}")
        object.__setattr__(self, "dim", int(dim))
        object.__setattr__(self, "blocks", int(blocks))

    def __eq__(self, other):
        return other.__class__ is Split and other.dim == self.dim and other.blocks == self.blocks

    def __ne__(self, other):
        return not self.__eq__(other)

    def __hash__(self):
        return hash(("S", self.dim)) if self.blocks == 1 else hash(("S", self.dim, self.blocks))

    def __reduce__(self):
        return (Split, (self.dim, self.blocks))

    def __repr__(self) -> str:
        return f"S({self.dim})" if self.blocks == 1 else f"S({self.dim}, blocks={self.blocks})"


class Broadcast(SbpValue):
    """``broadcast``: each rank of the axis holds the whole tensor."""
    __slots__ = ()
    is_broadcast = True

    def __eq__(self, other):
        return other.__class__ is Broadcast

    def __ne__(self, other):
        return other.__class__ is not Broadcast

    def __hash__(self):
        return hash("B")

    def __reduce__(self):
        return (Broadcast, ())

    def __repr__(self) -> str:
        return "B"


class PartialSum(SbpValue):
    """``partial_sum``: each rank of the axis holds a full-shape tensor; the logical tensor is their sum."""
    __slots__ = ()
    is_partial = True

    def __eq__(self, other):
        return other.__class__ is PartialSum

    def __ne__(self, other):
        return other.__class__ is not PartialSum

    def __hash__(self):
        return hash("P")

    def __reduce__(self):
        return (PartialSum, ())

    def __repr__(self) -> str:
        return "P"


def split(dim: int = 0, blocks: int = 1) -> Split:
    """``S(dim)``: balanced pieces along ``dim`` (negative dims are counted from the end).

    ``blocks=f``: ``dim`` holds ``f`` equal blocks side by side, each split on its own (a fused
    q/k/v weight split per head: ``split(1, blocks=3)`` on GPT-2's ``c_attn`` weight)."""
    return Split(dim, blocks)


broadcast = Broadcast()
partial_sum = PartialSum()
