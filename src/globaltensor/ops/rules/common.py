"""Small helpers shared by the rule modules."""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from ...sbp import Signature, broadcast, partial_sum, split
from ..args import get, tensor_positions

B, P = broadcast, partial_sum
S = split


def tensors_of(*args, **kwargs) -> list:
    """The tensor arguments in the order the dispatcher counts them."""
    positions = tensor_positions(args, kwargs)
    if positions is None:                     # nested deeper than one list: pytree finds them
        return [v for v in tree_flatten((args, kwargs))[0] if isinstance(v, torch.Tensor)]
    return [get(args, kwargs, p) for p in positions]


def sig(inputs, outputs) -> Signature:
    return Signature(tuple(inputs), tuple(outputs))


def norm_dim(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


def linear_cast(x: torch.Tensor, dtype) -> bool:
    """Casting partial pieces of ``x`` to ``dtype`` (None: no cast) keeps their sum."""
    if x.dtype == torch.bool:
        return False
    if dtype is None or dtype.is_floating_point or dtype.is_complex:
        return True
    return not (x.dtype.is_floating_point or x.dtype.is_complex)


def each_dim_kept(x: torch.Tensor, n_out: int = 1, linear: bool = False, skip=()) -> list:
    """``S(d) -> S(d)`` for every dim not in ``skip`` (and ``P -> P`` when the op is linear)."""
    out = [sig([S(d)], [S(d)] * n_out) for d in range(x.dim()) if d not in skip]
    if linear:
        out.append(sig([P], [P] * n_out))
    return out


def bind(op, args, kwargs) -> dict:
    """The op's arguments by schema name, defaults filled in (None where there is no default)."""
    out = {}
    for i, a in enumerate(op._schema.arguments):
        if i < len(args) and not a.kwarg_only:
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        else:
            out[a.name] = a.default_value if a.has_default_value() else None
    return out


def call_args(op, named: dict) -> tuple:
    """``(args, kwargs)`` for ``op`` from arguments by name (keyword-only ones as keywords)."""
    args, kwargs = [], {}
    for a in op._schema.arguments:
        if a.kwarg_only:
            kwargs[a.name] = named[a.name]
        else:
            args.append(named[a.name])
    return tuple(args), kwargs


def with_arg(op, args, kwargs, name, value) -> tuple:
    """``(args, kwargs)`` with argument ``name`` set to ``value``, wherever the caller put it."""
    names = [a.name for a in op._schema.arguments]
    i = names.index(name)
    if i < len(args) and not op._schema.arguments[i].kwarg_only:
        args = tuple(args[:i]) + (value,) + tuple(args[i + 1:])
    else:
        kwargs = dict(kwargs, **{name: value})
    return args, kwargs
