"""The cheapest way to call an op a task runs: torch's Python binding of it where it dispatches the
very same overload, else the overload's own ``_op``.

``aten.view.default._op(x, size)`` goes through the operator registry's boxed calling convention;
``Tensor.view(x, size)`` through the generated binding, its arguments parsed in C++: 0.4-3.5 us less
per call on small tensors (``sum`` 9.8 -> 6.3 us, ``detach`` 1.2 -> 0.6 us, measured here), which on a
simulated mesh of 64 ranks is tens of thousands of calls a step. A binding resolves overloads by its
arguments, so it is used for a task only when calling it on meta tensors of the task's arguments'
shapes, strides and dtypes dispatches exactly the task's overload, once, and nothing else; the
answer is kept per (op, arguments' kinds and constants).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_CHECKED: dict = {}


class _Dispatched(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _candidates(func) -> list:
    name = func.overloadpacket.__name__
    found = [getattr(torch._C._VariableFunctions, name, None), getattr(torch.Tensor, name, None)]
    return [f for f in found if callable(f)]


def _shape_key(v):
    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape), v.stride(), v.dtype)
    if isinstance(v, (list, tuple)):
        return (type(v), tuple(_shape_key(x) for x in v))
    try:
        hash(v)
    except TypeError:
        return ("id", id(v))
    return (type(v), v)


def fast_call(func, meta_args: tuple, meta_kwargs: dict) -> Optional[Callable]:
    """A binding that runs ``func`` on arguments like these (tensors as meta tensors of the task's
    shapes, strides and dtypes), or None where none is proven to."""
    if not isinstance(func, torch._ops.OpOverload) or func.namespace != "aten":
        return None
    key = (func, _shape_key(meta_args), _shape_key(tuple(sorted(meta_kwargs.items()))))
    if key in _CHECKED:
        return _CHECKED[key]
    found = None
    for binding in _candidates(func):
        mode = _Dispatched()
        try:
            with mode:
                binding(*meta_args, **meta_kwargs)
        except Exception:               # noqa: BLE001 -- a binding that does not take these arguments
            continue
        if mode.ops == [func]:
            found = binding
            break
    _CHECKED[key] = found
    return found
