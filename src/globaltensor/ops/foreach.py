"""A ``_foreach_*`` op's per-tensor op and one element's call of it.

The per-tensor op is found by name (``_foreach_add_`` -> ``add_``) and its overload by torch's
own resolution for the element's arguments (``add_.Tensor`` for a tensor list, ``add_.Scalar`` for
a number). list_ops.py decides each element's layouts by the dispatcher's decision for that call,
and runs an element on its own through it where no plain signature fits.
"""
from __future__ import annotations

from functools import lru_cache

import torch


@lru_cache(maxsize=None)
def _per_tensor_packet(func) -> tuple:
    """The per-tensor op packet, its positional capacity and keyword-only names."""
    packet = getattr(torch.ops.aten, func.overloadpacket.__name__[len("_foreach_"):])
    return (packet, *_positional_capacity(packet))


def _positional_capacity(op) -> tuple:
    """How many positional arguments the per-tensor op takes, and its keyword-only names in order.

    ``_foreach_addcdiv_(self, t1, t2, scalars)`` passes positionally what ``addcdiv_`` takes as
    ``value=``: arguments past the capacity go to the keyword-only ones.
    """
    schemas = [getattr(op, name)._schema for name in op.overloads()]
    capacity = max(sum(not a.kwarg_only for a in s.arguments) for s in schemas)
    keywords = next(([a.name for a in s.arguments if a.kwarg_only] for s in schemas
                     if any(a.kwarg_only for a in s.arguments)), [])
    return capacity, keywords


def element_call(func, args, kwargs, i: int, n: int) -> tuple:
    """``(per-tensor OpOverload, args, kwargs)`` of element ``i`` of a ``_foreach_*`` call."""
    packet, capacity, keywords = _per_tensor_packet(func)
    names = [a.name for a in func._schema.arguments]
    element = [v[i] if isinstance(v, (list, tuple)) and len(v) == n else
               (v[i].item() if names[k:k + 1] == ["scalars"] and isinstance(v, torch.Tensor) else v)
               for k, v in enumerate(args)]
    kw = dict(kwargs)
    if len(element) > capacity:
        kw.update(zip(keywords, element[capacity:]))
        element = element[:capacity]
    overload = torch._C._jit_resolve_packet(packet._qualified_op_name, *element, **kw)
    return getattr(packet, overload), tuple(element), kw
