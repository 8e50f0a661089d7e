"""Ops along one dim: scans (cumsum, cumprod, logcumsumexp, cummax / cummin) and sorts (sort, topk).

Each runs along its ``dim`` separately for every position of the other dims, so a split of
any other dim survives (``S(d) -> S(d)``): every rank scans or sorts whole lines of its own
piece, and its result is its piece of the output -- the indices too, which count positions
along ``dim``, a dim every rank holds whole. A split of ``dim`` itself has no candidate (a
scan needs the running total of the pieces before it, a sort the values of every piece):
such an input is gathered first.

``cumsum`` is linear: partial inputs pass through (``P -> P``) where its dtype cast is linear
too (not float -> int, never bool). Without these rules ``cumsum`` and ``cumprod`` would
decompose into a sum (product) over the input masked by an ``[n, n]`` triangle: memory
quadratic in the scanned dim.
The order statistics that reduce their dim (kthvalue, median, mode) are in reduction.py.
"""
from __future__ import annotations

from ..registry import aten, register_rule
from .common import P, S, bind, linear_cast, norm_dim, sig


def _along_dim(op, n_out: int, linear: bool = False):
    """Candidates of ``op(self, ..., dim)``: a split of every dim but ``dim``, ``P`` if linear."""
    def rule(*args, **kwargs):
        a = bind(op, args, kwargs)
        x = a["self"]
        dim = norm_dim(a["dim"], x.dim())
        cands = [sig([S(d)], [S(d)] * n_out) for d in range(x.dim()) if d != dim]
        if linear and linear_cast(x, a.get("dtype")):
            cands.append(sig([P], [P] * n_out))
        return cands
    return rule


def _register(ops, n_out: int, linear: bool = False) -> None:
    for op in ops:
        register_rule(op, _along_dim(op, n_out, linear))


_register([aten.cumsum.default, aten.cumsum_.default], 1, linear=True)
_register([aten.cumprod.default, aten.cumprod_.default, aten.logcumsumexp.default], 1)
_register([aten.cummax.default, aten.cummin.default, aten.sort.default, aten.sort.stable, aten.topk.default], 2)
