"""``_foreach_*`` ops (the optimizers' fast path) run as the per-tensor op on each list element.

Parameters of one optimizer may have different layouts, so each element gets its own
signature; the per-tensor op is found by name (``_foreach_add_`` -> ``add_``) and overload
resolution picks the variant matching the element's arguments.
"""
from __future__ import annotations

from functools import lru_cache

import torch


@lru_cache(maxsize=None)
def _per_tensor_op(func) -> tuple:
    """The per-tensor op, its positional capacity and keyword-only names, whether it returns."""
    op = getattr(torch.ops.aten, func.overloadpacket.__name__[len("_foreach_"):])
    return (op, *_positional_capacity(op), bool(func._schema.returns))


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


def run_foreach(func, args, kwargs):
    n = next(len(a) for a in args if isinstance(a, (list, tuple)))
    op, capacity, keywords, returns = _per_tensor_op(func)
    lists = [isinstance(a, (list, tuple)) for a in args]
    results = []
    for i in range(n):
        element = [a[i] if is_list else a for a, is_list in zip(args, lists)]
        if len(element) > capacity:
            keyword = dict(kwargs)
            keyword.update(zip(keywords, element[capacity:]))
            results.append(op(*element[:capacity], **keyword))
        else:
            results.append(op(*element, **kwargs))
    return results if returns else None
