"""p-norms (``torch.linalg.vector_norm``, ``torch.norm``) of split tensors as partial reductions.

A dim the norm keeps keeps its split, as for any reduction (reduction.py). A split of a dim the norm
*reduces* needs no gathering: each rank takes the norm of its piece, and the pieces' norms combine
over the ranks that split the reduced dims (ops/group_reduce.py):

- ``0 < |p| < inf``: ``(sum of the pieces' norm ** p) ** (1 / p)`` -- one all-reduce of the
  results' elements (a scalar for the norm of a whole tensor), then the root;
- ``p = 0`` (the count of non-zeros): the sum of the pieces' counts;
- ``p = inf`` / ``-inf``: the max / min of the pieces' norms (an all-gather of the pieces' results,
  as the worlds reduce by sum only).

A piece with nothing in a reduced dim, where torch refuses such a norm (``p = inf`` and ``p < 0``
have no identity), takes the value that leaves the others' combination as it is: 0 for ``inf``,
``inf`` for a negative ``p`` (``inf ** p = 0``). A tensor with nothing to reduce is refused as on
one device (every piece is empty, and the meta kernel refuses it first).

``S(d) -> B`` is the signature (the result is whole on every rank); the rule's kernel does the
rest. A partial input is reduced first: to a split where the cost model finds that cheaper (one
reduce-scatter and scalars, as ZeRO's reduce-scattered gradients are), else to broadcast. In any
split order (blocked, head-tail) a piece holds a set of elements whose norm combines alike. Under
``_foreach_norm`` (``clip_grad_norm_``'s foreach path) the whole list's results combine in one
collective per group of ranks (executor/lists.py runs its elements in :func:`group_reduce.batched`).
"""
from __future__ import annotations

import math

import torch

from ...comm.world import all_reduce_bytes
from ...boxing.layout import axis_groups
from .. import group_reduce
from ..registry import aten, register_rule
from .common import B, S, bind, first_arg_name, sig
from .reduction import Reduction, reduced_dims, reduction_candidates

_DIMS, _ALL = Reduction(), Reduction(dim_arg=None)
#: each overload and where its dims are; ``torch.norm`` with a number ``p`` reaches ``aten.norm``
_OPS = {aten.linalg_vector_norm.default: _DIMS, aten.norm.ScalarOpt_dim: _DIMS,
        aten.norm.ScalarOpt_dim_dtype: _DIMS, aten.norm.Scalar: _ALL, aten.norm.ScalarOpt_dtype: _ALL}


def _order(a: dict) -> float:
    """The norm's ``p`` (``ord`` of linalg_vector_norm, ``p`` of norm; None is 2)."""
    p = a["ord"] if "ord" in a else a.get("p")
    return 2.0 if p is None else float(p)


def _candidates(op, spec: Reduction):
    kept = reduction_candidates(op, spec)

    def rule(*args, **kwargs):
        a = bind(op, args, kwargs)
        x = a[first_arg_name(op)]
        return kept(*args, **kwargs) + [sig([S(d)], [B]) for d in reduced_dims(spec, x, a)]
    return rule


def _reducing_axes(x_layout, out_layout) -> tuple:
    """The placement axes on which the signature splits a reduced dim: split in, broadcast out."""
    return tuple(a for a, (u, v) in enumerate(zip(x_layout.nd_sbp, out_layout.nd_sbp))
                 if u.is_split and v.is_broadcast)


def _kernel(spec: Reduction):
    def kernel(func, args, kwargs, ins, outs, calls):
        axes = _reducing_axes(ins[0], outs[0])
        p = _order(bind(func, args, kwargs))
        results = {}
        for r, (ra, rkw) in calls.items():
            a = bind(func, ra, rkw)
            piece = a[first_arg_name(func)]
            empty = any(piece.shape[d] == 0 for d in reduced_dims(spec, piece, a))
            if empty and (p < 0 or math.isinf(p)):
                results[r] = torch.full(outs[0].piece_shape(r), 0.0 if p > 0 else math.inf, dtype=outs[0].dtype,
                                        device=piece.device)
            else:
                results[r] = func(*ra, **rkw)
        if axes:
            _combine(ins[0].placement, axes, p, results)
        return results
    return kernel


def _combine(placement, axes: tuple, p: float, results: dict) -> None:
    """The pieces' norms made the norm of the whole (module docstring)."""
    if math.isinf(p):
        group_reduce.combine_in_place(placement, axes, group_reduce.MAX if p > 0 else group_reduce.MIN, results)
        return
    if p == 0 or p == 1:
        group_reduce.combine_in_place(placement, axes, group_reduce.SUM, results)
        return
    for v in results.values():
        v.pow_(p)
    root = torch.sqrt if p == 2 else (lambda s: s.pow(1.0 / p))
    group_reduce.combine_in_place(placement, axes, group_reduce.SUM, results, root)


def _kernel_bytes(sources, ins, outs, recorded: bool) -> int:
    """An all-reduce of the result's piece over each group that splits a reduced dim (the all-gather an
    inf-norm makes instead differs by a few scalars' bytes)."""
    axes = _reducing_axes(ins[0], outs[0])
    if not axes:
        return 0
    out = outs[0]
    most = 0
    for group in axis_groups(out.placement, axes):
        numel = math.prod(out.piece_shape(group[0]))
        most = max(most, max(all_reduce_bytes(group, numel, out.dtype.itemsize).values()))
    return most


for _op, _spec in _OPS.items():
    register_rule(_op, _candidates(_op, _spec), kernel=_kernel(_spec), kernel_bytes=_kernel_bytes, any_order=True)
