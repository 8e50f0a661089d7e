"""SBP values: how a logical tensor relates to the piece one rank holds along one placement axis.

``split(d)``: the tensor is cut along dim ``d`` into balanced parts, one per rank of the axis.
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
    """``split(dim)``: each rank of the axis holds a balanced slice along ``dim``."""
    __slots__ = ("dim",)
    is_split = True

    def __init__(self, dim: int):
        if not isinstance(dim, numbers.Integral) or isinstance(dim, bool):
            raise TypeError(f"split(dim): expected an int dim, got {dim!r}")
        object.__setattr__(self, "dim", int(dim))

    def __eq__(self, other):
        return other.__class__ is Split and other.dim == self.dim

    def __ne__(self, other):
        return not self.__eq__(other)

    def __hash__(self):
        return hash(("S", self.dim))

    def __reduce__(self):
        return (Split, (self.dim,))

    def __repr__(self) -> str:
        return f"S({self.dim})"


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


def split(dim: int = 0) -> Split:
    """``S(dim)``: balanced pieces along ``dim`` (negative dims are counted from the end)."""
    return Split(dim)


broadcast = Broadcast()
partial_sum = PartialSum()
