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


def run_foreach(func, flat, spec):
    args, kwargs = tree_unflatten(flat, spec)
    n = next(len(a) for a in args if isinstance(a, (list, tuple)))
    op = _per_tensor_op(func)
    results = []
    for i in range(n):
        element = [a[i] if isinstance(a, (list, tuple)) else a for a in args]
        results.append(op(*element, **kwargs))
    return None if func._schema.returns == [] or not func._schema.returns else results
