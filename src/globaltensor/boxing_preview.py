"""Looking at boxing without running it."""
from __future__ import annotations

from .boxing import Layout, Plan, plan_boxing
from .placement import Placement
from .sbp import as_nd_sbp
from .tensor import GlobalTensor


def boxing_plan(x: GlobalTensor, placement=None, sbp=None) -> Plan:
    """The plan ``x.to_global(placement, sbp)`` would run: its steps (collective, groups, bytes)."""
    if not isinstance(x, GlobalTensor):
        raise TypeError(f"boxing_plan: expected a global tensor, got {type(x).__name__}")
    placement = x.placement if placement is None else placement
    if not isinstance(placement, Placement):
        raise TypeError(f"boxing_plan(placement=): expected a globaltensor placement, got {placement!r}")
    nd = as_nd_sbp(x.sbp if sbp is None else sbp, placement.ndim, x.dim(), "boxing_plan(sbp)")
    return plan_boxing(x.layout_meta, Layout(tuple(x.shape), x.dtype, placement, nd))
