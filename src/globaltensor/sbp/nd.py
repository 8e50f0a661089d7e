"""nd-SBP: one SBP value per placement axis, normalised and checked against a tensor."""
from __future__ import annotations

from typing import Optional

from .shape import blocks_problem
from .values import SbpValue, Split


def as_nd_sbp(sbp, ndim_placement: int, tensor_ndim: Optional[int] = None, name: str = "sbp") -> tuple:
    """Return ``sbp`` as a tuple of one :class:`SbpValue` per placement axis.

    A bare value is accepted for a 1-D placement; split dims are normalised against
    ``tensor_ndim`` when it is given. Raises TypeError for non-SBP entries and
    ValueError for a wrong length or a split dim out of range, naming ``name``.
    """
    if isinstance(sbp, SbpValue):
        sbp = (sbp,)
    elif isinstance(sbp, list):
        sbp = tuple(sbp)
    if not isinstance(sbp, tuple):
        raise TypeError(f"{name}: expected an SBP (split(d), broadcast, partial_sum) or a tuple of them, got {sbp!r}")
    bad = [v for v in sbp if not isinstance(v, SbpValue)]
    if bad:
        raise TypeError(f"{name}: expected SBP values (split(d), broadcast, partial_sum), got {bad[0]!r} in {sbp!r}")
    if len(sbp) != ndim_placement:
        raise ValueError(
            f"{name}: expected {ndim_placement} SBP value(s), one per placement axis, got {len(sbp)}: {sbp!r}")
    if tensor_ndim is not None:
        sbp = tuple(normalize_split(v, tensor_ndim, name) for v in sbp)
    return sbp


def normalize_split(v: SbpValue, tensor_ndim: int, name: str = "sbp") -> SbpValue:
    """``v`` with a negative split dim made positive; ValueError (naming ``name``) when out of range."""
    if not v.is_split:
        return v
    d = v.dim
    if not -tensor_ndim <= d < tensor_ndim:
        raise ValueError(
            f"{name}: split dim {d} is out of range for a tensor of {tensor_ndim} dims "
            f"(expected {-tensor_ndim}..{tensor_ndim - 1})" if tensor_ndim else
            f"{name}: split({d}) is impossible for a 0-dim tensor")
    return Split(d % tensor_ndim, v.blocks, v.order) if d < 0 else v


def split_axes(nd_sbp: tuple, dim: int) -> list:
    """The placement axes whose SBP splits tensor dim ``dim``, in axis order."""
    return [a for a, v in enumerate(nd_sbp) if v.is_split and v.dim == dim]


def check_blocks(shape: tuple, hierarchy: tuple, nd_sbp: tuple, name: str = "sbp") -> None:
    """ValueError (naming ``name``) when ``nd_sbp``'s blocked splits do not fit ``shape``."""
    problem = blocks_problem(tuple(shape), tuple(hierarchy), nd_sbp)
    if problem:
        raise ValueError(f"{name}: {nd_sbp!r} does not lay out a tensor of shape {tuple(shape)}: {problem}")
