"""Small helpers shared by the rule modules."""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from ...sbp import Signature, broadcast, partial_sum, split

B, P = broadcast, partial_sum
S = split


def tensors_of(*args, **kwargs) -> list:
    """The tensor arguments in the order the dispatcher counts them."""
    return [v for v in tree_flatten((args, kwargs))[0] if isinstance(v, torch.Tensor)]


def sig(inputs, outputs) -> Signature:
    return Signature(tuple(inputs), tuple(outputs))


def norm_dim(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


def each_dim_kept(x: torch.Tensor, n_out: int = 1, linear: bool = False, skip=()) -> list:
    """``S(d) -> S(d)`` for every dim not in ``skip`` (and ``P -> P`` when the op is linear)."""
    out = [sig([S(d)], [S(d)] * n_out) for d in range(x.dim()) if d not in skip]
    if linear:
        out.append(sig([P], [P] * n_out))
    return out
