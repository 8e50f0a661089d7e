"""Conjugate and negative views and their resolution: ``_conj``, ``_neg_view``, ``_conj_physical``,
``resolve_conj``, ``resolve_neg``, and ``view_as_complex``.

Each acts element by element, so every split stays where it is; each is linear over the reals
(conjugation and negation of a sum are the sums of the conjugates and negations), so partial
sums stay partial. ``_conj`` and ``_neg_view`` only set a bit on a view: the pieces carry it,
and the wrapper mirrors its pieces' bits (tensor.py), as torch reads them from the wrapper.
``view_as_complex`` pairs up the last dim (of size 2), which therefore never splits. Element by
element, every split kind holds as it is (blocked, head-tail: RoPE's complex view keeps a balanced
sequence split).
"""
from __future__ import annotations

from ..registry import aten, register_rule
from .common import each_dim_kept

register_rule([aten._conj.default, aten._neg_view.default, aten._conj_physical.default,
               aten.resolve_conj.default, aten.resolve_neg.default],
              lambda x: each_dim_kept(x, linear=True))
register_rule(aten.view_as_complex.default, lambda x: each_dim_kept(x, linear=True, skip=(x.dim() - 1,)))
