"""Matrix products: mm, bmm, addmm, baddbmm (matmul, linear and einsum decompose into these), their
candidates from their einsum specs (contraction.py), and pairwise distances (``torch.cdist``).

``_cdist_forward(x1 [..., P, M], x2 [..., R, M], p, compute_mode) -> [..., P, R]`` compares
rows with rows: a split of x1's rows splits the output's rows, a split of x2's rows its
columns, and a batch dim splits all three where x1 and x2 have the same batch shape (a
broadcast batch is gathered). The features ``M`` do not split: a p-norm is no sum of the
pieces' p-norms. ``torch.cdist`` sends ``p = 2`` with more than 25 rows to
``_euclidean_dist(x1, x2)`` instead (through a matrix product), which has the same
candidates. ``_cdist_backward(grad, x1, x2, p, cdist) -> grad of x1`` keeps the batch and row
splits, sums over a split of x2's rows (``P``), and is linear in the gradient.
"""
from __future__ import annotations

import torch

from ..registry import aten, register_rule
from .common import B, P, S, sig
from .contraction import contraction, plus_term

MM, BMM = contraction("mk,kn->mn"), contraction("bmk,bkn->bmn")
register_rule(aten.mm, MM)
register_rule(aten.bmm, BMM)


@register_rule(aten.addmm)
def _addmm(bias, a, b, **kwargs):
    return plus_term(bias, (a.shape[0], b.shape[1]), MM)


@register_rule(aten.baddbmm)
def _baddbmm(bias, a, b, **kwargs):
    return plus_term(bias, (a.shape[0], a.shape[1], b.shape[2]), BMM)


# -- pairwise distances --------------------------------------------------------------------------

def _cdist_batch(x1, x2) -> range:
    """Batch dims that split x1, x2 and the distances alike: all of them, or none where they broadcast."""
    return range(x1.dim() - 2) if x1.shape[:-2] == x2.shape[:-2] else range(0)


def _pairwise(x1, x2, *args, **kwargs):
    n = len(torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])) + 2
    return [sig([S(d), S(d)], [S(d)]) for d in _cdist_batch(x1, x2)] + [
        sig([S(x1.dim() - 2), B], [S(n - 2)]), sig([B, S(x2.dim() - 2)], [S(n - 1)])]


register_rule([aten._cdist_forward.default, aten._euclidean_dist.default], _pairwise)


@register_rule(aten._cdist_backward.default)
def _cdist_backward(grad, x1, x2, p, cdist):
    """Splits only where the batch shapes agree (a broadcast batch gives a gradient of the broadcast shape)."""
    linear = [sig([P, B, B, B], [P])]
    if x1.shape[:-2] != x2.shape[:-2]:
        return linear
    n = x1.dim()
    return [sig([S(d)] * 4, [S(d)]) for d in range(n - 2)] + [
        sig([S(n - 2), S(n - 2), B, S(n - 2)], [S(n - 2)]), sig([S(n - 1), B, S(n - 2), S(n - 1)], [P])] + linear
