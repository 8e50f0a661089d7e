"""Casts: ``_to_copy`` -- what ``x.to(dtype=..., device=..., layout=...)``, ``x.float()``,
``x.type_as(y)`` and ``softmax(x, dtype=...)`` reach.

Each rank casts its own piece, so every split is kept: ``S(d) -> S(d)``. A partial sum passes
only a widening cast (float32 -> float64, float16 -> float32, int32 -> int64, ...): a
narrowing one (float64 -> float32, float -> int, anything -> bool) would round each piece on
its own, and the sum of rounded pieces is not the rounded sum -- pieces that cancel could lose
every digit. A partial input of a narrowing cast is boxed first (to a split or to broadcast,
whichever costs less).

``device=`` names where the pieces live; it must be the placement's device type, and each
rank's piece goes to that rank's own device (``cuda`` on a process world means the rank's
GPU). Moving to another device type is a placement change: ``x.to_global(placement=...)``.
"""
from __future__ import annotations

import torch

from ...comm import get_world
from ..registry import aten, register_rule
from .common import P, S, bind, sig, widening, with_arg


def _candidates(x, **kwargs):
    dtype = kwargs.get("dtype")
    out = [sig([S(d)], [S(d)]) for d in range(x.dim())]
    if widening(x.dtype, x.dtype if dtype is None else dtype):
        out.append(sig([P], [P]))
    return out


def _on_rank_device(rank, ins, outs, *args, **kwargs):
    """The ``device`` argument as the device that holds ``rank``'s pieces."""
    named = bind(aten._to_copy.default, args, kwargs)
    device = named.get("device")
    if device is None or (torch.device(device).type == "meta" and named["self"].is_meta):
        return args, kwargs         # meta pieces (auto_plan's runs: a global tensor's .device is theirs)
    placement = ins[0].placement
    if torch.device(device).type == "meta":
        raise ValueError("_to_copy / Tensor.to(device='meta'): a global tensor has no meta copy; its meta is "
                         "global (x.shape, x.dtype, x.layout_meta). torch's ZeroTensor kernels (add, sub, mul, div, "
                         "linalg_cross) move their operands to 'meta' to infer the result's shape, so a "
                         "torch._efficientzerotensor cannot meet a global tensor in them: materialise it first "
                         "(torch.zeros(z.shape, dtype=z.dtype))")
    if torch.device(device).type != placement.type:
        raise ValueError(f"_to_copy / Tensor.to(device=): a global tensor on a {placement.type!r} placement "
                         f"cannot move to device {str(device)!r} by a cast; got device={device!r}. Move it with "
                         f"x.to_global(placement=gt.placement({torch.device(device).type!r}, ranks))")
    return with_arg(aten._to_copy.default, args, kwargs, "device", get_world().device(placement.type, rank))


register_rule(aten._to_copy.default, _candidates, local=_on_rank_device, any_order=True)
