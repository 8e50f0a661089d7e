"""``searchsorted(sorted_sequence, values)``: each value is looked up on its own, so a split of the
values stays, the result split alike. A 1-D sequence serves every value (broadcast); an N-D
one pairs its leading dims with the values' (``sorter`` alike), so those dims split together
and the searched (last) dim never splits."""
from __future__ import annotations

from ..registry import aten, register_rule
from .common import B, S, bind, sig


@register_rule(aten.searchsorted.Tensor)
def _searchsorted(*args, **kwargs):
    a = bind(aten.searchsorted.Tensor, args, kwargs)
    seq, values, sorter = a["sorted_sequence"], a["self"], a["sorter"]
    extra = 1 if sorter is not None else 0
    if seq.dim() == 1:
        return [sig([B, S(d)] + [B] * extra, [S(d)]) for d in range(values.dim())]
    return [sig([S(d), S(d)] + [S(d)] * extra, [S(d)]) for d in range(values.dim() - 1)
            if seq.shape[d] == values.shape[d]]
