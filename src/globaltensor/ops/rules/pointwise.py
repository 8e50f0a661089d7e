"""Pointwise ops (every op tagged ``pointwise``): a split dim of the output splits each input's
matching dim, or leaves it broadcast where the input has size 1 or lacks the dim.

Partial sums pass through where the op is linear in them: P+P and P-P, P*B and B*P, P/B,
-P, where(c, P, P), casts between floating types, clone / copy.
"""
from __future__ import annotations

import torch

from ..registry import aten, register_rule, register_tag_rule
from .common import B, P, S, sig, tensors_of

# op name -> which inputs may be partial together (positions among tensor inputs)
_LINEAR = {
    "add": [(0, 1)], "add_": [(0, 1)], "sub": [(0, 1)], "sub_": [(0, 1)],
    "mul": [(0,), (1,)], "mul_": [(0,), (1,)], "div": [(0,)], "div_": [(0,)],
    "neg": [(0,)], "neg_": [(0,)], "clone": [(0,)], "_to_copy": [(0,)], "copy_": [(0, 1)],
    "where": [(1, 2)], "alias": [(0,)], "detach": [(0,)], "lift_fresh": [(0,)],
    "positive": [(0,)], "real": [(0,)], "conj_physical": [(0,)], "view_as_real": [(0,)],
}


def _out_shape(ts) -> tuple:
    return tuple(torch.broadcast_shapes(*[t.shape for t in ts]))


def pointwise_candidates(ts, out_ndim: int, out_shape: tuple, partial_groups=()) -> list:
    cands = []
    for d in range(out_ndim):
        ins = []
        for t in ts:
            k = d - (out_ndim - t.dim())
            ins.append(S(k) if k >= 0 and (t.shape[k] != 1 or out_shape[d] == 1) else B)
        cands.append(sig(ins, [S(d)]))
    for group in partial_groups:
        if all(i < len(ts) for i in group) and all(ts[i].dtype.is_floating_point or ts[i].dtype.is_complex
                                                    for i in group):
            cands.append(sig([P if i in group else B for i in range(len(ts))], [P]))
    return cands


def _pointwise(func_name):
    def rule(*args, **kwargs):
        ts = tensors_of(*args, **kwargs)
        if not ts:
            return []
        shape = _out_shape(ts)
        groups = _LINEAR.get(func_name, ())
        if func_name == "_to_copy" and not (kwargs.get("dtype") or ts[0].dtype).is_floating_point:
            groups = ()
        return pointwise_candidates(ts, len(shape), shape, groups)
    return rule


def _register_all():
    names = set(_LINEAR) | {"masked_fill", "masked_fill_", "bitwise_not", "logical_not", "nan_to_num", "clamp",
                            "clamp_", "pow", "threshold_backward", "gelu_backward", "silu_backward",
                            "tanh_backward", "sigmoid_backward", "eq", "ne", "lt", "le", "gt", "ge"}
    for name in names:
        packet = getattr(aten, name, None)
        if packet is not None:
            register_rule(packet, _pointwise(name))


_register_all()
register_tag_rule(torch.Tag.pointwise, _pointwise(""))

register_rule([aten.fill_, aten.zero_], lambda x, *a, **k: [sig([S(d)] + [B] * (len(tensors_of(x, *a)) - 1), [S(d)])
                                                             for d in range(x.dim())])
