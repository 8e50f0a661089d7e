"""``_foreach_*`` ops (the optimizers' fast path) run as the per-tensor op on each list element.

Parameters of one optimizer may have different layouts, so each element gets its own
signature; the per-tensor op is found by name (``_foreach_add_`` -> ``add_``) and overload
resolution picks the variant matching the element's arguments.
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_unflatten


def _per_tensor_op(func):
    name = func.overloadpacket.__name__[len("_foreach_"):]
    return getattr(torch.ops.aten, name)


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


def run_foreach(func, flat, spec):
    args, kwargs = tree_unflatten(flat, spec)
    n = next(len(a) for a in args if isinstance(a, (list, tuple)))
    op = _per_tensor_op(func)
    capacity, keywords = _positional_capacity(op)
    results = []
    for i in range(n):
        element = [a[i] if isinstance(a, (list, tuple)) else a for a in args]
        keyword = dict(kwargs)
        keyword.update(zip(keywords, element[capacity:]))
        results.append(op(*element[:capacity], **keyword))
    return None if func._schema.returns == [] or not func._schema.returns else results
