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


_KEYWORD_ONLY = {"value", "alpha"}


def run_foreach(func, flat, spec):
    args, kwargs = tree_unflatten(flat, spec)
    names = [a.name for a in func._schema.arguments]
    n = next(len(a) for a in args if isinstance(a, (list, tuple)))
    op = _per_tensor_op(func)
    results = []
    for i in range(n):
        positional, keyword = [], dict(kwargs)
        for name, a in zip(names, args):
            v = a[i] if isinstance(a, (list, tuple)) else a
            if name in _KEYWORD_ONLY:
                keyword[name] = v
            else:
                positional.append(v)
        results.append(op(*positional, **keyword))
    return None if func._schema.returns == [] or not func._schema.returns else results
