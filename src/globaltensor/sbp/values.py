"""SBP values: how a logical tensor relates to the piece one rank holds along one placement axis.

``split(d)``: the tensor is cut along dim ``d`` into balanced parts, one per rank of the axis.
``split(d, blocks=f)``: dim ``d`` is ``f`` equal blocks laid side by side (a fused ``[q | k | v]``
weight, or the ``(batch, heads)`` pair a view merged into one dim) and every block is cut into
balanced parts; a rank holds its part of each block, in block order.
``split(d, order="head_tail")``: dim ``d`` (each of its blocks, with ``blocks=f``) is cut into ``2W``
balanced chunks for the ``W`` ranks of the axis, and rank ``r`` holds chunks ``r`` and ``2W - 1 - r``,
in that order: the balanced split of a causal sequence, where every rank's queries see as many keys.
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


ORDERS = ("plain", "head_tail")


class Split(SbpValue):
    """``split(dim)``: each rank of the axis holds a balanced slice along ``dim``; with ``blocks=f``
    > 1, its balanced slice of each of the ``f`` equal blocks of ``dim``, the slices in block order;
    with ``order="head_tail"``, two chunks of each block (see the module's docstring)."""
    __slots__ = ("dim", "blocks", "order")
    is_split = True

    def __init__(self, dim: int, blocks: int = 1, order: str = "plain"):
        if not isinstance(dim, numbers.Integral) or isinstance(dim, bool):
            raise TypeError(f"split(dim): expected an int dim, got {dim!r}")
        if not isinstance(blocks, numbers.Integral) or isinstance(blocks, bool) or blocks < 1:
            raise TypeError(f"split(dim, blocks): expected blocks to be an int >= 1, got {blocks!r}")
        if order not in ORDERS:
            raise ValueError(f"split(dim, order): expected order to be one of {ORDERS}, got {order!r}")
        object.__setattr__(self, "dim", int(dim))
        object.__setattr__(self, "blocks", int(blocks))
        object.__setattr__(self, "order", order)

    @property
    def head_tail(self) -> bool:
        """Whether a rank holds two chunks of each block, ``r`` and ``2W - 1 - r`` (see the module)."""
        return self.order == "head_tail"

    @property
    def blocked(self) -> bool:
        """Whether this is a blocked split in plain order (its pieces are boxes of the factored tensor)."""
        return self.blocks > 1 and self.order == "plain"

    def __eq__(self, other):
        return (other.__class__ is Split and other.dim == self.dim and other.blocks == self.blocks
                and other.order == self.order)

    def __ne__(self, other):
        return not self.__eq__(other)

    def __hash__(self):
        if self.order != "plain":
            return hash(("S", self.dim, self.blocks, self.order))
        return hash(("S", self.dim)) if self.blocks == 1 else hash(("S", self.dim, self.blocks))

    def __reduce__(self):
        return (Split, (self.dim, self.blocks, self.order))

    def __repr__(self) -> str:
        extra = (f", blocks={self.blocks}" if self.blocks > 1 else "") + \
            (f", order={self.order!r}" if self.order != "plain" else "")
        return f"S({self.dim}{extra})"


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


def split(dim: int = 0, blocks: int = 1, order: str = "plain") -> Split:
    """``S(dim)``: balanced pieces along ``dim`` (negative dims are counted from the end).

    ``blocks=f``: ``dim`` holds ``f`` equal blocks side by side, each split on its own (a fused
    q/k/v weight split per head: ``split(1, blocks=3)`` on GPT-2's ``c_attn`` weight).
    ``order="head_tail"``: the balanced split of a causal sequence -- ``dim`` cut into ``2W``
    chunks, rank ``r`` holding chunks ``r`` and ``2W - 1 - r`` (``S(1, order="head_tail")``)."""
    return Split(dim, blocks, order)


broadcast = Broadcast()
partial_sum = PartialSum()
