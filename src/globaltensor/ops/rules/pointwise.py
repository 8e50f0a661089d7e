"""Pointwise ops (every op tagged ``pointwise``): a split dim of the output splits each input's
matching dim, or leaves it broadcast where the input has size 1 or lacks the dim.

Partial sums pass through only where the op is linear in them, all partial inputs together
and every other tensor input broadcast: P+P and P-P (any ``alpha``), P*B and B*P, P/B (true
division only: a rounding mode is not linear), -P, ``where(c, P, P)`` (the condition
broadcast), ``lerp(P, P, w)``, ``addcmul(P, P, B)``, ``masked_fill(P, m, 0)``, casts between
floating types, clone / copy / alias. A partial operand must be floating (or complex), and so
must the result: ``_to_copy`` or ``copy_`` to an integer or bool type rounds, so it never keeps
P. A scalar added to a partial tensor (``P + 1``) is not linear: it would be added once per
rank, so that input is boxed first, as it is for every other (nonlinear) op.
"""
from __future__ import annotations

import torch

from ..registry import aten, register_rule, register_tag_rule
from .common import B, P, S, sig, tensors_of

# op name -> groups of tensor inputs (positions in dispatch order) that may be partial together
_LINEAR = {
    "add": [(0, 1)], "add_": [(0, 1)], "sub": [(0, 1)], "sub_": [(0, 1)], "rsub": [(0, 1)],
    "mul": [(0,), (1,)], "mul_": [(0,), (1,)], "div": [(0,)], "div_": [(0,)],
    "neg": [(0,)], "neg_": [(0,)], "positive": [(0,)],
    "clone": [(0,)], "_to_copy": [(0,)], "copy": [(0, 1)], "copy_": [(0, 1)],
    "alias": [(0,)], "detach": [(0,)], "lift_fresh": [(0,)],
    "real": [(0,)], "imag": [(0,)], "conj_physical": [(0,)], "view_as_real": [(0,)],
    "where": [(1, 2)], "lerp": [(0, 1)], "lerp_": [(0, 1)],
    "addcmul": [(0, 1), (0, 2)], "addcmul_": [(0, 1), (0, 2)], "addcdiv": [(0, 1)], "addcdiv_": [(0, 1)],
    "masked_fill": [(0,)], "masked_fill_": [(0,)],
}

def _linear_dtype(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def _out_shape(ts) -> tuple:
    return tuple(torch.broadcast_shapes(*[t.shape for t in ts]))


def pointwise_candidates(ts, out_ndim: int, out_shape: tuple, partial_groups=()) -> list:
    """``S(d)`` of the output from the matching dim of every input (B where it broadcasts), and
    ``P`` for each group of inputs the op is linear in (the others broadcast)."""
    cands = []
    for d in range(out_ndim):
        ins = []
        for t in ts:
            k = d - (out_ndim - t.dim())
            ins.append(S(k) if k >= 0 and (t.shape[k] != 1 or out_shape[d] == 1) else B)
        cands.append(sig(ins, [S(d)]))
    for group in partial_groups:
        if all(i < len(ts) for i in group) and all(_linear_dtype(ts[i].dtype) for i in group):
            cands.append(sig([P if i in group else B for i in range(len(ts))], [P]))
    return cands


def _partial_groups(name: str, ts, args, kwargs) -> list:
    groups = _LINEAR.get(name, ())
    if not groups:
        return []
    if name in ("div", "div_") and kwargs.get("rounding_mode") is not None:
        return []                                   # floor / trunc division is not linear
    if name == "_to_copy" and not _linear_dtype(kwargs.get("dtype") or ts[0].dtype):
        return []                                   # a cast to an integer or bool type rounds
    if name in ("masked_fill", "masked_fill_"):
        value = args[2] if len(args) > 2 else kwargs.get("value")
        if isinstance(value, torch.Tensor) or value != 0:
            return []                               # only a zero fill is linear
    if name in ("copy", "copy_") and not all(_linear_dtype(t.dtype) for t in ts[:2]):
        return []
    return list(groups)


def _pointwise(func_name: str):
    def rule(*args, **kwargs):
        ts = tensors_of(*args, **kwargs)
        if not ts:
            return []
        shape = _out_shape(ts)
        return pointwise_candidates(ts, len(shape), shape, _partial_groups(func_name, ts, args, kwargs))
    return rule


def _register_all():
    names = set(_LINEAR) | {"bitwise_not", "logical_not", "nan_to_num", "clamp", "clamp_", "pow",
                            "threshold_backward", "gelu_backward", "silu_backward", "tanh_backward",
                            "sigmoid_backward", "eq", "ne", "lt", "le", "gt", "ge"}
    for name in names:
        packet = getattr(aten, name, None)
        if packet is not None:
            register_rule(packet, _pointwise(name))


_register_all()
register_tag_rule(torch.Tag.pointwise, _pointwise(""))


def _fill(x, *args, **kwargs):
    """``fill_(x, v)``: every piece filled in place keeps its split (a tensor ``v`` is 0-dim: B)."""
    n_other = len(tensors_of(x, *args, **kwargs)) - 1
    return [sig([S(d)] + [B] * n_other, [S(d)]) for d in range(x.dim())]


register_rule([aten.fill, aten.fill_], _fill)
register_rule([aten.zero, aten.zero_], lambda x: [sig([S(d)], [S(d)]) for d in range(x.dim())] + [sig([P], [P])])
