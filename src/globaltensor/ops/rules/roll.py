"""``roll``: elements move along the rolled dims only, so a split of any other dim stays; moving
elements is linear, so partial sums stay partial. ``roll`` without ``dims`` rolls the
flattened tensor: no split survives that."""
from __future__ import annotations

from ..registry import aten, register_rule
from .common import P, each_dim_kept, norm_dim, sig


@register_rule(aten.roll.default)
def _roll(x, shifts, dims=()):
    if not dims:
        return [sig([P], [P])]
    return each_dim_kept(x, linear=True, skip={norm_dim(d, x.dim()) for d in dims})
