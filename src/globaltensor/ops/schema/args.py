"""Where the tensors sit in an op's arguments, and putting other values in their place.

The hot path avoids pytree: an op's arguments are a tuple of leaves and flat lists, plus
keyword arguments, so a tensor's position is (0, index, item) in the positional arguments
or (1, name, item) in the keyword ones, ``item`` being None unless it sits in a list. The
positions come in pytree order, the order rules count tensor inputs in.
"""
from __future__ import annotations

from typing import Optional

import torch

#: the argument values taken as they are -- keyed, compared and frozen by value -- not as tensors
SCALARS = (int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def tensor_positions(args: tuple, kwargs: dict) -> Optional[list]:
    """Positions of the tensors, or None when a tensor is nested deeper than one list."""
    out = []
    for where, items in ((0, enumerate(args)), (1, kwargs.items())):
        for i, v in items:
            if isinstance(v, torch.Tensor):
                out.append((where, i, None))
            elif isinstance(v, (list, tuple)):
                for j, x in enumerate(v):
                    if isinstance(x, torch.Tensor):
                        out.append((where, i, j))
                    elif isinstance(x, (list, tuple)) and any(isinstance(y, torch.Tensor) for y in x):
                        return None
    return out


def get(args: tuple, kwargs: dict, pos: tuple):
    where, i, j = pos
    v = args[i] if where == 0 else kwargs[i]
    return v if j is None else v[j]


class Substitution:
    """Builds the arguments of one rank's call: the given values at the tensor positions."""

    def __init__(self, positions: list):
        self.positions = positions
        self.nested_args = sorted({i for w, i, j in positions if w == 0 and j is not None})
        self.nested_kwargs = sorted({i for w, i, j in positions if w == 1 and j is not None})
        self.flat_indices = [i for _, i, _ in positions] if all(w == 0 and j is None for w, _, j in positions) \
            else None

    def __call__(self, args: tuple, kwargs: dict, values) -> tuple:
        if self.flat_indices is not None:
            a = list(args)
            for i, v in zip(self.flat_indices, values):
                a[i] = v
            return a, kwargs
        a = list(args)
        for i in self.nested_args:
            a[i] = list(a[i])
        kw = dict(kwargs)
        for k in self.nested_kwargs:
            kw[k] = list(kw[k])
        for (where, i, j), v in zip(self.positions, values):
            target = a if where == 0 else kw
            if j is None:
                target[i] = v
            else:
                target[i][j] = v
        return a, kw
