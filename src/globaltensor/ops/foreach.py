"""A ``_foreach_*`` op's per-tensor op and one element's call of it.

The per-tensor op is the record's (``_foreach_add_`` -> ``add_``; ``_foreach_maximum_`` ->
``maximum(x, y, out=x)``, there being no ``maximum_``), its overload found by torch's own resolution
for the element's arguments (``add_.Tensor`` for a tensor list, ``add_.Scalar`` for a number). decide/lists.py decides each element's layouts by the dispatcher's decision for that call,
and runs an element on its own through it where no plain signature fits.
"""
from __future__ import annotations

import torch

from .schema.op_record import record


def element_call(func, args, kwargs, i: int, n: int) -> tuple:
    """``(per-tensor OpOverload, args, kwargs)`` of element ``i`` of a ``_foreach_*`` call."""
    rec = record(func)
    packet, capacity, keywords, out_is_self = rec.per_tensor
    names = rec.names
    element = [v[i] if isinstance(v, (list, tuple)) and len(v) == n else
               (v[i].item() if names[k:k + 1] == ("scalars",) and isinstance(v, torch.Tensor) else v)
               for k, v in enumerate(args)]
    kw = dict(kwargs)
    if len(element) > capacity:
        kw.update(zip(keywords, element[capacity:]))
        element = element[:capacity]
    if out_is_self:
        kw["out"] = element[0]
    overload = torch._C._jit_resolve_packet(packet._qualified_op_name, *element, **kw)
    return getattr(packet, overload), tuple(element), kw
