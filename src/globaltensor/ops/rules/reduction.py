"""Reductions: sum, mean, amax/amin, max/min, argmax/argmin, var/std, logsumexp, any/all, prod,
and the order statistics of one dim (kthvalue, median, nanmedian, mode).

Every reduction keeps a split of a dim it does not reduce (renumbered when ``keepdim`` is
false): each rank reduces whole rows of its own piece, so its result is its piece of the
output, empty pieces included.

A split of a *reduced* dim gives a candidate only where the pieces' results combine by a
sum, exactly, for every piece:

- ``sum`` / ``nansum``: ``S(d) -> P`` (the sum of the pieces' sums; an empty piece sums to 0).
  ``nanmean`` needs no rule: PyTorch composes it (before dispatch) of ``nansum`` divided by
  a ``sum`` counting the non-NaN elements, both partial on a split reduced dim.
- ``mean``: ``S(d) -> P`` with each rank dividing by the *global* count. ``mean`` of a piece
  divides by the piece's own count, which differs between uneven pieces, so ``local``
  scales the piece by ``local count / global count`` first (a piece with no elements in the
  reduced dims becomes a zero row: its mean must be 0, not NaN). The alternative -- no rule,
  letting PyTorch decompose mean into ``prims.sum`` / ``prims.div`` -- is exact too, but
  ``prims.div`` has no rule and would gather; the override keeps one local op and a
  partial result with no communication.
- max/min/argmax/var/std/logsumexp/any/all/prod and the order statistics do not combine
  by a sum (indices over a split dim are local ones), so a split reduced dim is gathered
  first: no candidate. Off the reduced dim their indices are exact too: they count positions
  along that dim, which every rank holds whole. Norms combine by their own rule (vector_norm.py).

Partial inputs pass through only the linear reductions, sum and mean (``P -> P``), and only
where the dtype cast before reducing is linear too (not float -> int, never bool).

The table at the bottom says, per overload, which argument holds the dims and what an empty
dim list means; ``dim=None`` always means every dim.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ...compat.torch_ops import prims
from ..registry import aten, register_rule
from .common import P, S, bind, first_arg_name, linear_cast, norm_dim, sig, with_arg



# -- reading an op's arguments by name --------------------------------------------------------





# -- the rule ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Reduction:
    """How one overload reduces: where its dims are and how its pieces' results combine."""
    dim_arg: Optional[str] = "dim"   # None: always every dim
    empty_is_all: bool = True        # dim=[] means every dim (any/all.dims: no dim)
    n_out: int = 1
    split_sums: bool = False         # reducing a split dim gives P
    linear: bool = False             # P -> P
    divides: bool = False            # mean: pieces divide by the global count (see ``_mean_local``)


def reduced_dims(spec: Reduction, x, a: dict) -> tuple:
    """The dims of ``x`` the op reduces, sorted and non-negative (none of a 0-dim ``x``)."""
    dims = a.get(spec.dim_arg) if spec.dim_arg else None
    if x.dim() == 0:
        return ()
    if dims is None:
        return tuple(range(x.dim()))
    if isinstance(dims, int):
        dims = [dims]
    if len(dims) == 0:
        return tuple(range(x.dim())) if spec.empty_is_all else ()
    return tuple(sorted({norm_dim(d, x.dim()) for d in dims}))


def _global_count(shape, dims) -> int:
    n = 1
    for d in dims:
        n *= shape[d]
    return n


def reduction_candidates(op, spec: Reduction):
    def rule(*args, **kwargs):
        a = bind(op, args, kwargs)
        x = a[first_arg_name(op)]
        reduced = reduced_dims(spec, x, a)
        keepdim = bool(a.get("keepdim", False))
        cands = [sig([S(d)], [S(d if keepdim else d - sum(r < d for r in reduced))] * spec.n_out)
                 for d in range(x.dim()) if d not in reduced]
        # mean over no element is NaN on every piece as on one device: no P out of an empty count
        if spec.split_sums and (not spec.divides or _global_count(x.shape, reduced) > 0):
            cands += [sig([S(d)], [P] * spec.n_out) for d in reduced]
        if spec.linear and linear_cast(x, a.get("dtype")):
            cands.append(sig([P], [P] * spec.n_out))
        return cands
    return rule


def _mean_local(op, spec: Reduction):
    """Make a rank's ``mean`` of its piece come out as (sum of the piece) / (global count)."""
    def local(rank, ins, outs, *args, **kwargs):
        a = bind(op, args, kwargs)
        piece = a[first_arg_name(op)]
        reduced = reduced_dims(spec, piece, a)
        total = _global_count(ins[0].shape, reduced)
        here = _global_count(piece.shape, reduced)
        if here == total:
            return args, kwargs
        dtype = a.get("dtype") or piece.dtype
        if here == 0:   # an empty piece of a split reduced dim: a zero row means to 0
            shape = [1 if d in reduced and n == 0 else n for d, n in enumerate(piece.shape)]
            scaled = torch.zeros(shape, dtype=dtype, device=piece.device)
        else:
            scaled = piece.to(dtype) * (here / total)
        return with_arg(op, args, kwargs, first_arg_name(op), scaled)
    return local


def _register(ops, spec: Reduction) -> None:
    for op in ops:
        register_rule(op, reduction_candidates(op, spec), local=_mean_local(op, spec) if spec.divides else None,
                      any_order=True)


_ALL = Reduction(dim_arg=None)
_DIMS = Reduction()
_PRIMS = Reduction(dim_arg="dims")

_register([aten.sum.default], Reduction(dim_arg=None, split_sums=True, linear=True))
_register([aten.sum.dim_IntList], Reduction(split_sums=True, linear=True))
_register([prims.sum.default], Reduction(dim_arg="dims", split_sums=True, linear=True))
# nansum drops NaNs piece by piece: pieces of a partial input need not hold the NaNs of their sum
_register([aten.nansum.default], Reduction(split_sums=True))
_register([aten.mean.default], Reduction(dim_arg=None, split_sums=True, linear=True, divides=True))
_register([aten.mean.dim], Reduction(split_sums=True, linear=True, divides=True))

_register([aten.amax.default, aten.amin.default, aten.logsumexp.default,
           aten.argmax.default, aten.argmin.default, aten.prod.dim_int, aten.any.dim, aten.all.dim,
           aten.var.dim, aten.std.dim, aten.var.correction, aten.std.correction], _DIMS)
_register([aten.max.default, aten.min.default, aten.prod.default, aten.any.default, aten.all.default,
           aten.var.default, aten.std.default], _ALL)
_register([aten.any.dims, aten.all.dims], Reduction(empty_is_all=False))
_register([aten.max.dim, aten.min.dim, aten.aminmax.default, aten.var_mean.correction, aten.std_mean.correction,
           aten.var_mean.dim, aten.std_mean.dim, aten.kthvalue.default, aten.median.dim, aten.nanmedian.dim,
           aten.mode.default], Reduction(n_out=2))
_register([prims.amax.default, prims.amin.default, prims.prod.default, prims.var.default], _PRIMS)
