"""Reading a one-element global tensor as a Python number: ``bool(x)``, ``int(x)``, ``float(x)``,
``if mask.any():`` -- all of which reach ``aten._local_scalar_dense``.

It is a collective read, as ``x.item()`` is: the tensor is boxed to broadcast (a partial sum
all-reduced, a split gathered) and every rank returns the same number. It returns no tensor,
so no SBP signature describes it; the dispatcher runs it here, without the fallback's warning.
"""
from __future__ import annotations

from ..tensor import GlobalTensor
from ..compat.torch_ops import aten

SCALAR_READS = frozenset({aten._local_scalar_dense.default})


def read_scalar(args: tuple, kwargs: dict):
    """The number ``_local_scalar_dense(x)`` gives on the logical tensor, on every rank."""
    x = args[0] if args else kwargs["self"]
    if not isinstance(x, GlobalTensor):
        raise TypeError(f"_local_scalar_dense: expected a global tensor, got {type(x).__name__}")
    return x.item()
