"""Matrix products: mm, bmm, addmm, baddbmm (matmul, linear and einsum decompose into these)."""
from __future__ import annotations

from ..registry import aten, register_rule
from .common import B, P, S, sig

register_rule(aten.mm, ["S(0), B -> S(0)", "B, S(1) -> S(1)", "S(1), S(0) -> P", "P, B -> P", "B, P -> P"])
register_rule(aten.bmm, ["S(0), S(0) -> S(0)", "S(1), B -> S(1)", "B, S(2) -> S(2)", "S(2), S(1) -> P",
                         "P, B -> P", "B, P -> P"])


def _bias(bias, out_shape, out_dim):
    """The bias's SBP when the output is split along ``out_dim`` (bias broadcasts against it)."""
    k = out_dim - (len(out_shape) - bias.dim())
    return S(k) if k >= 0 and bias.shape[k] != 1 else B


@register_rule(aten.addmm)
def _addmm(bias, a, b, **kwargs):
    shape = (a.shape[0], b.shape[1])
    return [sig([_bias(bias, shape, 0), S(0), B], [S(0)]), sig([_bias(bias, shape, 1), B, S(1)], [S(1)]),
            sig([P, S(1), S(0)], [P]), sig([P, P, B], [P]), sig([P, B, P], [P])]


@register_rule(aten.baddbmm)
def _baddbmm(bias, a, b, **kwargs):
    shape = (a.shape[0], a.shape[1], b.shape[2])
    return [sig([_bias(bias, shape, 0), S(0), S(0)], [S(0)]), sig([_bias(bias, shape, 1), S(1), B], [S(1)]),
            sig([_bias(bias, shape, 2), B, S(2)], [S(2)]), sig([P, S(2), S(1)], [P]),
            sig([P, P, B], [P]), sig([P, B, P], [P])]
