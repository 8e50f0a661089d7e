"""SBP values: how a logical tensor relates to the piece one rank holds along one placement axis.

``split(d)``: the tensor is cut along dim ``d`` into balanced parts, one per rank of the axis.
``broadcast``: every rank holds the whole tensor.
``partial_sum``: every rank holds a tensor of the full shape; the logical tensor is their sum.
"""
from __future__ import annotations

from dataclasses import dataclass


class SbpValue:
    """Base of the three SBP kinds; instances are immutable and hashable."""

    __slots__ = ()
    is_split = False
    is_broadcast = False
    is_partial = False


@dataclass(frozen=True, slots=True)
class Split(SbpValue):
    dim: int
    is_split = True

    def __post_init__(self):
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise TypeError(f"split(dim): expected an int dim, got {self.dim!r}")

    def __repr__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Broadcast(SbpValue):
    is_broadcast = True

    def __repr__(self) -> str:
        return "B"


@dataclass(frozen=True, slots=True)
class PartialSum(SbpValue):
    is_partial = True

    def __repr__(self) -> str:
        return "P"


def split(dim: int = 0) -> Split:
    """``S(dim)``: balanced pieces along ``dim`` (negative dims are counted from the end)."""
    return Split(dim)


broadcast = Broadcast()
partial_sum = PartialSum()
