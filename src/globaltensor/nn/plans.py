"""Sharding plans as data: ``{parameter-name pattern: sbp}``.

A plan maps fnmatch-style patterns over a module's parameter (and buffer) names --
``"*.attn.qkv.weight"``, ``"blocks.*.mlp.fc?.bias"`` -- to an SBP (1-D placements) or an
nd-SBP tuple, one value per placement axis. Names no pattern matches are broadcast on
every axis. The first matching pattern, in the plan's order, decides.

The Megatron-style tensor-parallel layouts of an ``nn.Linear`` (weight ``[out, in]``):

- column parallel: the output features are split -- weight ``S(0)``, bias ``S(0)``; the
  layer's output comes out split on its last dim, no communication;
- row parallel: the input features are split -- weight ``S(1)``, bias ``B``; fed a
  last-dim-split input, the layer's output is a partial sum, reduced where it is needed.

A column-parallel layer followed by a row-parallel one (attention's qkv -> proj, the MLP's
fc1 -> fc2) needs one reduction per pair in the forward pass.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Optional

from ..sbp import broadcast, split

#: Per-parameter SBPs, on the tensor-parallel axis, of a column-parallel ``nn.Linear``.
COLUMN_PARALLEL: Mapping[str, object] = {"weight": split(0), "bias": split(0)}
#: Per-parameter SBPs, on the tensor-parallel axis, of a row-parallel ``nn.Linear``.
ROW_PARALLEL: Mapping[str, object] = {"weight": split(1), "bias": broadcast}
#: A replicated layer: every parameter broadcast.
REPLICATED: Mapping[str, object] = {"weight": broadcast, "bias": broadcast}


def _check_axis(axis: int, ndim: int) -> None:
    if not isinstance(ndim, int) or ndim < 1:
        raise ValueError(f"ndim: expected the placement's number of axes (>= 1), got {ndim!r}")
    if not isinstance(axis, int) or not 0 <= axis < ndim:
        raise ValueError(f"axis: expected a placement axis in 0..{ndim - 1}, got {axis!r}")


def on_axis(sbp, axis: int = 0, ndim: int = 1):
    """``sbp`` on placement axis ``axis`` and broadcast on the others: an nd-SBP tuple
    (a bare SBP when ``ndim`` is 1)."""
    _check_axis(axis, ndim)
    if ndim == 1:
        return sbp
    return tuple(sbp if a == axis else broadcast for a in range(ndim))


def layer_plan(pattern: str, layout: Mapping[str, object], axis: int = 0, ndim: int = 1) -> dict:
    """The plan entries of one layer kind: ``layout`` maps a parameter's own name (``"weight"``)
    to its SBP on ``axis``; ``pattern`` names the module (``"*.attn.qkv"``)."""
    if not isinstance(pattern, str):
        raise TypeError(f"layer_plan: expected a module-name pattern (str), got {pattern!r}")
    return {f"{pattern}.{name}": on_axis(sbp, axis, ndim) for name, sbp in layout.items()}


def column_parallel(pattern: str, axis: int = 0, ndim: int = 1) -> dict:
    """Plan entries making the ``nn.Linear`` modules matching ``pattern`` column parallel on ``axis``."""
    return layer_plan(pattern, COLUMN_PARALLEL, axis, ndim)


def row_parallel(pattern: str, axis: int = 0, ndim: int = 1) -> dict:
    """Plan entries making the ``nn.Linear`` modules matching ``pattern`` row parallel on ``axis``."""
    return layer_plan(pattern, ROW_PARALLEL, axis, ndim)


def megatron_plan(column: Iterable[str] = (), row: Iterable[str] = (), *, axis: int = 0, ndim: int = 1,
                  extra: Optional[Mapping[str, object]] = None) -> dict:
    """A tensor-parallel plan: the ``column`` module patterns column parallel, the ``row`` ones row
    parallel, on placement axis ``axis`` of an ``ndim``-axis placement (broadcast on the others, e.g.
    the data axis); ``extra`` entries come first and so take precedence."""
    plan: dict = dict(extra or {})
    for entries in [column_parallel(p, axis, ndim) for p in column] + [row_parallel(p, axis, ndim) for p in row]:
        for key, sbp in entries.items():
            plan.setdefault(key, sbp)
    return plan
