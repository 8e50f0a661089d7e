"""Pointwise ops (every op tagged ``pointwise``): a split dim of the output splits each input's
matching dim, or leaves it broadcast where the input has size 1 or lacks the dim.

Partial sums pass through only where the op is linear in them, all partial inputs together
and every other tensor input broadcast: P+P and P-P (any ``alpha``), P*B and B*P, P/B (true
division only: a rounding mode is not linear), -P, ``where(c, P, P)`` (the condition
broadcast), ``lerp(P, P, w)``, ``addcmul(P, P, B)``, ``masked_fill(P, m, 0)``, clone / copy /
alias, and the activation gradients (``threshold_backward``, ``gelu_backward``, ...) in their
incoming gradient. A partial operand must be floating (or complex), and so must the result;
``copy_`` keeps P only into a dtype that widens the source's: a narrowing one (float64 ->
float32, float -> int) rounds each piece on its own (casts, ``_to_copy``: rules/cast.py). A
scalar added to a partial tensor (``P + 1``) is not linear: it would be added once per rank,
so that input is boxed first, as it is for every other (nonlinear) op.

The groups name schema arguments (``self``, ``other``, ...), not positions among the tensors:
a Python scalar operand takes no tensor position, and an ``out=`` tensor is not an operand --
it takes the output's SBP in every candidate, so an out= op writes its own layout.
"""
from __future__ import annotations

import torch

from ..schema.op_record import record
from ..registry import aten, register_rule, register_tag_rule
from ...sbp import broadcast_shape
from .common import B, P, S, bind, is_zero, sig, tensors_of, widening

# op name -> groups of arguments (by schema name) that may be partial together
_SELF = [("self",)]
_LINEAR = {
    "add": [("self", "other")], "add_": [("self", "other")], "sub": [("self", "other")],
    "sub_": [("self", "other")], "rsub": [("self", "other")],
    "mul": [("self",), ("other",)], "mul_": [("self",), ("other",)], "div": _SELF, "div_": _SELF,
    "neg": _SELF, "neg_": _SELF, "positive": _SELF, "clone": _SELF,
    "copy": [("self", "src")], "copy_": [("self", "src")],
    "alias": _SELF, "detach": _SELF, "lift_fresh": _SELF,
    "real": _SELF, "imag": _SELF, "conj_physical": _SELF, "view_as_real": _SELF,
    "where": [("self", "other")], "lerp": [("self", "end")], "lerp_": [("self", "end")],
    "addcmul": [("self", "tensor1"), ("self", "tensor2")], "addcmul_": [("self", "tensor1"), ("self", "tensor2")],
    "addcdiv": [("self", "tensor1")], "addcdiv_": [("self", "tensor1")],
    "masked_fill": _SELF, "masked_fill_": _SELF,
    # activation gradients are linear in the incoming gradient
    "threshold_backward": [("grad_output",)], "gelu_backward": [("grad_output",)],
    "silu_backward": [("grad_output",)], "tanh_backward": [("grad_output",)],
    "sigmoid_backward": [("grad_output",)], "hardshrink_backward": [("grad_out",)],
    "softshrink_backward": [("grad_output",)],
}


def _linear_dtype(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def _out_shape(ts) -> tuple:
    return broadcast_shape(*[t.shape for t in ts])


def pointwise_candidates(ts, out_ndim: int, out_shape: tuple, partial_groups=(), follow_output=()) -> list:
    """``S(d)`` of the output from the matching dim of every input (B where it broadcasts), and
    ``P`` for each group of inputs (positions in ``ts``) the op is linear in, the others
    broadcast -- except those in ``follow_output`` (an ``out=`` tensor), which take the output's."""
    cands = []
    for d in range(out_ndim):
        ins = []
        for t in ts:
            k = d - (out_ndim - t.dim())
            ins.append(S(k) if k >= 0 and (t.shape[k] != 1 or out_shape[d] == 1) else B)
        cands.append(sig(ins, [S(d)]))
    for group in partial_groups:
        if all(i < len(ts) for i in group) and all(_linear_dtype(ts[i].dtype) for i in group):
            cands.append(sig([P if i in group or i in follow_output else B for i in range(len(ts))], [P]))
    return cands




def _partial_groups(name: str, op, ts, named: dict) -> list:
    """The groups of ``_LINEAR[name]`` as positions among the tensors, where they are linear here."""
    if name in ("div", "div_") and named.get("rounding_mode") is not None:
        return []                                   # floor / trunc division is not linear
    if name in ("masked_fill", "masked_fill_"):
        value = named.get("value")
        if isinstance(value, torch.Tensor) or value != 0:
            return []                               # only a zero fill is linear
    if name in ("copy", "copy_") and not (all(_linear_dtype(named[k].dtype) for k in ("self", "src")
                                               if isinstance(named.get(k), torch.Tensor))
                                           and widening(named["src"].dtype, named["self"].dtype)):
        return []                                   # a narrowing copy rounds each piece
    if not all(_linear_dtype(t.dtype) for t in _written_outs(op, named)):
        return []                                   # an out= tensor of an integer type rounds
    position = {id(t): i for i, t in enumerate(ts)}
    groups = []
    for group in _LINEAR.get(name, ()):
        if all(isinstance(named.get(a), torch.Tensor) for a in group):
            groups.append(tuple(position[id(named[a])] for a in group))
    return groups


def _written_outs(op, named: dict) -> list:
    """The ``out=`` tensors (keyword-only written arguments)."""
    return [named[a.name] for a in record(op).written if a.kwarg_only and isinstance(named.get(a.name), torch.Tensor)]


def _pointwise(func_name: str, op=None):
    def rule(*args, **kwargs):
        ts = tensors_of(*args, **kwargs)
        if not ts:
            return []
        shape = _out_shape(ts)
        if op is None or func_name not in _LINEAR:
            return pointwise_candidates(ts, len(shape), shape)
        named = bind(op, args, kwargs)
        outs = {id(t) for t in _written_outs(op, named)}
        follow = tuple(i for i, t in enumerate(ts) if id(t) in outs)
        return pointwise_candidates(ts, len(shape), shape, _partial_groups(func_name, op, ts, named), follow)
    return rule


def _register_all():
    names = set(_LINEAR) | {"bitwise_not", "logical_not", "nan_to_num", "clamp", "clamp_", "pow",
                            "threshold_backward", "gelu_backward", "silu_backward", "tanh_backward",
                            "sigmoid_backward", "eq", "ne", "lt", "le", "gt", "ge"}
    for name in names:
        packet = getattr(aten, name, None)
        if packet is not None:
            for overload in packet.overloads():
                op = getattr(packet, overload)
                register_rule(op, _pointwise(name, op),
                              keyed={"value": is_zero} if name in ("masked_fill", "masked_fill_") else None)


_register_all()
register_tag_rule(torch.Tag.pointwise, _pointwise(""))


def _fill(x, *args, **kwargs):
    """``fill_(x, v)``: every piece filled in place keeps its split (a tensor ``v`` is 0-dim: B)."""
    n_other = len(tensors_of(x, *args, **kwargs)) - 1
    return [sig([S(d)] + [B] * n_other, [S(d)]) for d in range(x.dim())]


register_rule([aten.fill, aten.fill_], _fill)
register_rule([aten.zero, aten.zero_], lambda x: [sig([S(d)], [S(d)]) for d in range(x.dim())] + [sig([P], [P])])
