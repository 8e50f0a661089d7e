"""Small helpers shared by the rule modules."""
from __future__ import annotations

import math

import torch
from torch.utils._pytree import tree_flatten

from ...sbp import Signature, broadcast, partial_sum, split
from ..schema.args import get, tensor_positions
from ..schema.op_record import record

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


def is_zero(v) -> bool:
    """For ``register_rule(keyed=)``: whether a number argument is zero (a tensor given there: False),
    where a rule's candidates differ for zero (a zero fill keeps a partial sum)."""
    return not isinstance(v, torch.Tensor) and v == 0


def norm_dim(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


def widening(src: torch.dtype, dst: torch.dtype) -> bool:
    """Every value of ``src`` is exactly a value of ``dst``: a cast partial pieces may pass, their sum
    kept. A narrowing cast (float64 -> float32, float -> int, ...) rounds each piece on its own,
    so the sum of the rounded pieces is not the rounded sum."""
    if src == dst:
        return src != torch.bool
    if torch.bool in (src, dst):
        return False
    if src.is_complex and not dst.is_complex:
        return False
    src_real, dst_real = src.to_real(), dst.to_real()
    if src_real.is_floating_point:
        if not dst_real.is_floating_point:
            return False
        s, d = torch.finfo(src_real), torch.finfo(dst_real)
        return d.eps <= s.eps and d.max >= s.max and d.tiny <= s.tiny
    s = torch.iinfo(src_real)
    if dst_real.is_floating_point:       # exact while the significand holds every integer of src
        significand_bits = 1 - round(math.log2(torch.finfo(dst_real).eps))
        return max(s.max, -s.min) <= 2 ** significand_bits
    d = torch.iinfo(dst_real)
    return d.min <= s.min and d.max >= s.max


def linear_cast(x: torch.Tensor, dtype) -> bool:
    """Casting partial pieces of ``x`` to ``dtype`` (None: no cast) keeps their sum: a widening cast."""
    return widening(x.dtype, x.dtype if dtype is None else dtype)


def each_dim_kept(x: torch.Tensor, n_out: int = 1, linear: bool = False, skip=()) -> list:
    """``S(d) -> S(d)`` for every dim not in ``skip`` (and ``P -> P`` when the op is linear)."""
    out = [sig([S(d)], [S(d)] * n_out) for d in range(x.dim()) if d not in skip]
    if linear:
        out.append(sig([P], [P] * n_out))
    return out


def bind(op, args, kwargs) -> dict:
    """The op's arguments by schema name, defaults filled in (None where there is no default)."""
    return record(op).bind(args, kwargs)


def call_args(op, named: dict) -> tuple:
    """``(args, kwargs)`` for ``op`` from arguments by name (keyword-only ones as keywords)."""
    return record(op).call_args(named)


def with_arg(op, args, kwargs, name, value) -> tuple:
    """``(args, kwargs)`` with argument ``name`` set to ``value``, wherever the caller put it."""
    return record(op).with_arg(args, kwargs, name, value)


def first_arg_name(op) -> str:
    """The name of the op's first argument (``self``, ``input``)."""
    return record(op).args[0].name
