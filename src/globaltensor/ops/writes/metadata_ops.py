"""In-place ops that change a tensor's metadata: ``transpose_``, ``t_``, ``squeeze_``, ``unsqueeze_``,
``as_strided_`` (``swapdims_`` / ``swapaxes_`` come apart into ``transpose_`` above dispatch).

Such an op (tagged ``inplace_view``) writes no data; it gives the tensor new sizes and strides,
so the rule of in-place ops -- the written tensor keeps its layout -- cannot hold. On a global
tensor it runs as its out-of-place view op (``transpose``, ``squeeze``, ...) through the
dispatcher, so the SBP comes from that op's rule: ``transpose_(0, 1)`` takes ``S(0)`` to
``S(1)``, ``P`` and ``B`` stay, and a layout the rule takes as it is moves no data (one it
does not, e.g. a split of a dim ``squeeze_`` removes, is boxed first). The tensor then takes
the result's layout and pieces -- views of its own pieces under the op -- and the wrapper's
own sizes and strides are set by running the op on the wrapper alone, with dispatch disabled
and on meta (as torch's ``return_and_correct_aliasing`` does). The object stays the same:
``x.transpose_(0, 1) is x``, and autograd records the op on it. ``resize_`` / ``resize_as_`` keep
the elements: to the tensor's own shape, or (contiguous) to another of as many elements, as a
view; growing or shrinking raises. ``as_strided`` has no rule:
``as_strided_`` gathers the tensor through the fallback (with its warning) and leaves it
broadcast.

The pieces are replaced by those views rather than changed in place: a piece object may be
shared by two global tensors (boxing to the layout a tensor already has keeps its pieces),
and the other one must keep its shape.
"""
from __future__ import annotations

import math
import torch
from torch.utils._mode_utils import no_dispatch

from ...tensor import GlobalTensor
from ...compat.torch_ops import aten
from .written_inputs import written_objects
from ..schema.op_record import record
from .copy_views import rebase



def is_inplace_view(func) -> bool:
    return record(func).inplace_view


def run_inplace_view(func, args, kwargs):
    """Run a metadata in-place op on the global tensor it changes; returns that tensor."""
    x = _changed(func, args, kwargs)
    # bad arguments get torch's own error here, before anything has changed
    func(_probe(func, x), *map(_meta, args[1:]), **kwargs)
    op, rest, kw = _out_of_place(func, x, args[1:], kwargs)
    y = op(x, *rest, **kw)
    _set_wrapper_meta(func, args, kwargs)
    rebase(x, op, rest, kw)
    x._layout, x._pieces, x._boxed = y._layout, dict(y._pieces), None
    return x


def _changed(func, args, kwargs) -> GlobalTensor:
    written = written_objects(func, args, kwargs)
    if len(written) != 1 or not isinstance(written[0], GlobalTensor) or not args or args[0] is not written[0]:
        raise TypeError(f"{func}: expected the global tensor it changes as its first positional argument")
    return written[0]


def _out_of_place(func, x, rest, kwargs):
    """The out-of-place op and its arguments other than ``x``.

    ``squeeze_()`` becomes ``squeeze(dims)`` of the dims of global size 1: ``squeeze()`` on the
    pieces would also drop a split dim whose piece happens to have size 1, so its rule would
    have to box such a split."""
    if func is aten.squeeze_.default:
        return aten.squeeze.dims, ([d for d in range(x.dim()) if x.shape[d] == 1],), kwargs
    if func in (aten.resize_.default, aten.resize_as_.default):
        return _resize(func, x, tuple(rest[0].shape if func is aten.resize_as_.default else rest[0]))
    twin = record(func).functional
    if twin is None:
        raise NotImplementedError(f"{func}: no out-of-place overload of {func.overloadpacket.__name__[:-1]} takes "
                                  f"the same arguments")
    return twin, rest, kwargs


_DIM_OPS = {aten.transpose_.default, aten.t_.default, aten.squeeze_.default, aten.squeeze_.dim, aten.squeeze_.dims,
            aten.unsqueeze_.default}


def _probe(func, x):
    """A stand-in for ``x`` to check ``func``'s arguments on: for the ops that check only dims, an
    empty CPU tensor of ``x``'s rank -- the device kernel raises torch's own error (the meta kernels
    of some releases assert instead); for the others (sizes and strides matter) ``x`` on meta."""
    if func in _DIM_OPS:
        return torch.empty((0,) * x.dim(), dtype=x.dtype)
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")


def _meta(v):
    return torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, GlobalTensor) else v


def _resize(func, x, size: tuple):
    """``resize_`` / ``resize_as_`` keeping the elements: the same shape (an alias), or a
    contiguous tensor viewed as another shape of as many elements (its storage order)."""
    if size == tuple(x.shape):
        return aten.alias.default, (), {}
    if x.is_contiguous() and math.prod(size) == x.numel():
        return aten.view.default, (list(size),), {}
    raise NotImplementedError(f"{func}: a global tensor of shape {tuple(x.shape)} cannot be resized to {size}: "
                              f"only to its own shape or, when contiguous, to another of as many elements "
                              f"(new elements would be uninitialised memory); make a new global tensor instead")


def _set_wrapper_meta(func, args, kwargs) -> None:
    """Run ``func`` on the wrapper alone: below ``__torch_dispatch__``, on its meta kernel, so
    only the wrapper's sizes and strides change."""
    with no_dispatch():
        meta = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            func(*args, **kwargs)
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta)
