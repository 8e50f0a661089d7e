"""Tensors made after another: zeros_like / ones_like / full_like / empty_like and new_zeros /
new_ones / new_full / new_empty.

``*_like`` makes a tensor of the input's shape, so each rank's result is the right piece for
every layout the input has: ``S(d) -> S(d)``, a blocked split too (optimizer states made with
``zeros_like`` of a fused ``[q | k | v]`` parameter stay laid out as it is). A partial input's pieces have the full shape,
and the values made do not depend on the input's, so ``P -> B`` (a fill of the whole tensor
on every rank is a broadcast). ``zeros_like`` may also keep ``P -> P``: zeros sum to zero;
``ones_like`` may not (k ranks of ones sum to k).

``new_*(x, size)`` takes ``size`` as the *global* size. Every rank making the whole tensor
is a broadcast, whatever ``x``'s layout; where ``size`` is ``x``'s own shape the new tensor
keeps ``x``'s split instead, and ``local`` gives each rank its piece's shape.

``rand_like`` / ``randn_like`` / ``randint_like`` take the same layouts as the other ``*_like`` ops but must not
run the aten op on the pieces: it would draw from torch's generator, different on every rank
(broadcast replicas that differ) and blind to where a piece lies. They run through a
``kernel`` drawing from the sharding-invariant generator (ops/rng.py) exactly as
``gt.rand`` / ``gt.randn`` do: one counter reservation per call, in every process, and each
rank hashes only the positions of its own piece (its box, or a head-tail piece's chunks) -- so
``torch.rand_like(x)`` is the same logical tensor as ``gt.rand(*x.shape, ...)`` after the same seed, for any layout of ``x``
(``randint_like`` floors ``low + u * (high - low)`` from 53-bit uniforms). A ``generator=`` argument is not supported (its overload has no rule).

``scalar_tensor`` takes no tensor, so it never reaches the dispatcher of global tensors.
"""
from __future__ import annotations

import torch

from ...sbp import contiguous_strides
from .. import rng
from ..registry import aten, register_rule
from .common import B, P, S, bind, sig, with_arg


def _like(partial_stays: bool):
    def rule(x, *args, **kwargs):
        cands = [sig([S(d)], [S(d)]) for d in range(x.dim())] + [sig([P], [B])]
        return cands + [sig([P], [P])] if partial_stays else cands
    return rule


register_rule(aten.zeros_like.default, _like(partial_stays=True))
register_rule([aten.ones_like.default, aten.full_like.default, aten.empty_like.default], _like(partial_stays=False))


def _random_like(draw):
    def kernel(func, args, kwargs, ins, outs, calls):
        layout = outs[0]
        n = 1
        for s in layout.shape:
            n *= s
        offset = rng.next_offset(max(1, n))   # as the factories reserve, so rand_like(x) == gt.rand(x.shape)
        return {r: draw(rng.piece_positions(layout, r, a[0].device), offset, layout.dtype)
                for r, (a, kw) in calls.items()}
    return kernel


register_rule(aten.rand_like.default, _like(partial_stays=False), kernel=_random_like(rng.uniform), any_order=True)
register_rule(aten.randn_like.default, _like(partial_stays=False), kernel=_random_like(rng.normal), any_order=True)


def _randint_like(func, args, kwargs, ins, outs, calls):
    """Integers in [low, high) from the sharding-invariant uniform (53 bits), floored."""
    a = bind(func, args, kwargs)
    low, high = a.get("low") or 0, a["high"]

    def draw(pos, offset, dtype):
        return (low + torch.floor(rng.uniform(pos, offset, torch.float64) * (high - low))).to(dtype)
    return _random_like(draw)(func, args, kwargs, ins, outs, calls)


register_rule([aten.randint_like.default, aten.randint_like.low_dtype], _like(partial_stays=False),
              kernel=_randint_like, any_order=True)


def _new(op):
    def rule(*args, **kwargs):
        a = bind(op, args, kwargs)
        x, size = a["self"], tuple(a["size"])
        kept = [sig([S(d)], [S(d)]) for d in range(x.dim())] if size == tuple(x.shape) else []
        return kept + [sig([S(d)], [B]) for d in range(x.dim())] + [sig([P], [B])]

    def local(rank, ins, outs, *args, **kwargs):
        shape = list(outs[0].piece_shape(rank))
        args, kwargs = with_arg(op, args, kwargs, "size", shape)
        if "stride" in bind(op, args, kwargs):  # new_empty_strided: the piece's own strides
            args, kwargs = with_arg(op, args, kwargs, "stride", list(contiguous_strides(shape)))
        return args, kwargs
    return rule, local


for _op in (aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, aten.new_empty.default,
            aten.new_empty_strided.default):
    _rule, _local = _new(_op)
    register_rule(_op, _rule, local=_local, any_order=True)
