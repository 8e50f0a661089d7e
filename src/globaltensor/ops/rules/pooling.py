"""Pooling and resampling over trailing spatial dims: max / avg / adaptive pools, upsampling
(nearest, linear, bilinear, bicubic, trilinear), im2col / col2im, and their backward ops;
the backward of replication padding.

Each works on every plane -- one position of the leading (batch, channel) dims -- on its
own, so a split of a leading dim survives: ``S(d) -> S(d)`` (the max-pool indices too, which
count positions within a plane). A split of a spatial dim has no candidate: windows would
cross the pieces' edges. im2col folds the channels into its output's dim 1 (``C * kh * kw``),
whose balanced pieces are not the channels' ones, so there only the batch dim splits; the
same for col2im.

Average pools, upsampling and im2col / col2im are linear (``P -> P``); their backward ops,
and max pooling's, are linear in the incoming gradient (``P, B -> P``, the other tensors
broadcast). An upsampling backward is given the input's global size, which ``local``
replaces by the rank's piece shape.

The CPU kernels refuse an empty channel dim, which a rank's piece has where the channels
are fewer than the ranks, so the ops run through a ``kernel`` that makes the empty output
pieces itself.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..registry import aten, register_rule
from .common import B, P, S, bind, first_arg_name, sig, tensors_of, with_arg


def _planes(x, spatial: int) -> range:
    """The leading dims of ``x``: those before its ``spatial`` trailing ones."""
    return range(max(x.dim() - spatial, 0))


def _forward(spatial: Optional[int], n_out: int = 1, linear: bool = False):
    """Candidates of ``op(x, ...)`` pooling or resampling ``spatial`` trailing dims of its first
    tensor (None: as many as its ``output_size`` has): a split of a leading dim, ``P`` if linear."""
    def rule(op):
        def candidates(*args, **kwargs):
            a = bind(op, args, kwargs)
            x = a[first_arg_name(op)]
            k = len(a["output_size"]) if spatial is None else spatial
            cands = [sig([S(d)], [S(d)] * n_out) for d in _planes(x, k)]
            return cands + ([sig([P], [P] * n_out)] if linear else [])
        return candidates
    return rule


def _backward(spatial: int):
    """Candidates of ``op(grad_output, self, ..., [indices])``: every tensor split alike, or the
    gradient partial and the others broadcast."""
    def rule(op):
        def candidates(*args, **kwargs):
            ts = tensors_of(*args, **kwargs)
            cands = [sig([S(d)] * len(ts), [S(d)]) for d in _planes(ts[1], spatial)]
            return cands + [sig([P] + [B] * (len(ts) - 1), [P])]
        return candidates
    return rule


def _local_input_size(op):
    """The upsampling backward's ``input_size`` is the gradient's shape: the rank's piece's."""
    def local(rank, ins, outs, *args, **kwargs):
        return with_arg(op, args, kwargs, "input_size", list(outs[0].piece_shape(rank)))
    return local


def _batch_only(ndim: int):
    """im2col / col2im: only the batch dim splits, and only an input of ``ndim`` dims has one."""
    def rule(op):
        def candidates(x, *args, **kwargs):
            return ([sig([S(0)], [S(0)])] if x.dim() == ndim else []) + [sig([P], [P])]
        return candidates
    return rule


def _empty_pieces_kernel(func, args, kwargs, ins, outs, calls):
    """The op on each rank's pieces, except where every output piece is empty: those are made
    here, since the pooling kernels raise on an empty channel dim."""
    results = {}
    for r, (a, kw) in calls.items():
        shapes = [o.piece_shape(r) for o in outs]
        if all(math.prod(s) == 0 for s in shapes):
            device = tensors_of(*a, **kw)[0].device
            empty = [torch.empty(s, dtype=o.dtype, device=device) for s, o in zip(shapes, outs)]
            results[r] = empty[0] if len(empty) == 1 else tuple(empty)
        else:
            results[r] = func(*a, **kw)
    return results


def _register(ops, make_rule, local=None) -> None:
    for op in ops:
        register_rule(op, make_rule(op), local=local(op) if local else None, kernel=_empty_pieces_kernel)


_register([aten.max_pool2d_with_indices.default, aten.adaptive_max_pool2d.default], _forward(2, n_out=2))
_register([aten.max_pool3d_with_indices.default, aten.adaptive_max_pool3d.default], _forward(3, n_out=2))
_register([aten.avg_pool2d.default, aten._adaptive_avg_pool2d.default], _forward(2, linear=True))
_register([aten.avg_pool3d.default, aten._adaptive_avg_pool3d.default], _forward(3, linear=True))
_register([aten.max_pool2d_with_indices_backward.default, aten.avg_pool2d_backward.default,
           aten._adaptive_avg_pool2d_backward.default, aten.adaptive_max_pool2d_backward.default], _backward(2))
_register([aten.max_pool3d_with_indices_backward.default, aten.avg_pool3d_backward.default,
           aten._adaptive_avg_pool3d_backward.default, aten.adaptive_max_pool3d_backward.default], _backward(3))

_UPSAMPLE = ["upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
             "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
             "upsample_bicubic2d", "upsample_trilinear3d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa"]
_register([getattr(aten, name).default for name in _UPSAMPLE], _forward(None, linear=True))
_register([getattr(aten, name + "_backward").default for name in _UPSAMPLE], _forward(None, linear=True),
          local=_local_input_size)

_register([aten.im2col.default], _batch_only(4))
_register([aten.col2im.default], _batch_only(3))
_register([aten.replication_pad1d_backward.default], _backward(1))
_register([aten.replication_pad2d_backward.default], _backward(2))
_register([aten.replication_pad3d_backward.default], _backward(3))
