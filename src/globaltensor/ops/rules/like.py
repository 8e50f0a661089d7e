"""Tensors made after another: zeros_like / ones_like / full_like / empty_like and new_zeros /
new_ones / new_full / new_empty.

``*_like`` makes a tensor of the input's shape, so each rank's result is the right piece for
every layout the input has: ``S(d) -> S(d)``. A partial input's pieces have the full shape,
and the values made do not depend on the input's, so ``P -> B`` (a fill of the whole tensor
on every rank is a broadcast). ``zeros_like`` may also keep ``P -> P``: zeros sum to zero;
``ones_like`` may not (k ranks of ones sum to k).

``new_*(x, size)`` takes ``size`` as the *global* size. Every rank making the whole tensor
is a broadcast, whatever ``x``'s layout; where ``size`` is ``x``'s own shape the new tensor
keeps ``x``'s split instead, and ``local`` gives each rank its piece's shape.

Not here: ``rand_like`` / ``randn_like`` must draw from the sharding-invariant generator
(ops/rng.py), which a rule cannot reach -- the local op would draw from torch's generator,
different on every rank -- and ``scalar_tensor`` takes no tensor, so it never reaches the
dispatcher of global tensors.
"""
from __future__ import annotations

from ..registry import aten, register_rule
from .common import B, P, S, sig
from .reduction import schema_args, with_arg


def _like(partial_stays: bool):
    def rule(x, *args, **kwargs):
        cands = [sig([S(d)], [S(d)]) for d in range(x.dim())] + [sig([P], [B])]
        return cands + [sig([P], [P])] if partial_stays else cands
    return rule


register_rule(aten.zeros_like.default, _like(partial_stays=True))
register_rule([aten.ones_like.default, aten.full_like.default, aten.empty_like.default], _like(partial_stays=False))


def _new(op):
    def rule(*args, **kwargs):
        a = schema_args(op, args, kwargs)
        x, size = a["self"], tuple(a["size"])
        kept = [sig([S(d)], [S(d)]) for d in range(x.dim())] if size == tuple(x.shape) else []
        return kept + [sig([S(d)], [B]) for d in range(x.dim())] + [sig([P], [B])]

    def local(rank, ins, outs, *args, **kwargs):
        return with_arg(op, args, kwargs, "size", list(outs[0].piece_shape(rank)))
    return rule, local


for _op in (aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, aten.new_empty.default):
    _rule, _local = _new(_op)
    register_rule(_op, _rule, local=_local)
