"""An op's output meta for global-shape arguments, without running it on full-size data.

Ops run on meta tensors of the global shapes. Functional pointwise ops take a shortcut:
their output has the inputs' broadcast shape and the dtype the op gives on one-element
tensors of the inputs' dtypes and ranks. Torch's meta path for them goes through
``torch._refs`` (type promotion, stride propagation), which was most of the time a new
shape's first call took.

A ``device`` argument (``_to_copy(x, device=cpu)``, ``new_zeros(..., device=...)``) names the
pieces' device; on meta tensors it becomes ``meta``, since copying a meta tensor to a real
device has no data to copy. Where the pieces go is the rule's business (rules/cast.py).
"""
from __future__ import annotations

import torch

from ...sbp import broadcast_shape
from .op_record import record

_SHORTCUT: dict = {}


def output_meta(func, meta_args: tuple, meta_kwargs: dict):
    """``func``'s result on these meta arguments (tensors, tuples of tensors, or anything else)."""
    meta_args, meta_kwargs = _on_meta_device(func, meta_args, meta_kwargs)
    if _takes_shortcut(func) and not _has_tensor_lists(meta_args, meta_kwargs):
        shapes = [v.shape for v in (*meta_args, *meta_kwargs.values()) if isinstance(v, torch.Tensor)]
        try:
            tiny = func(*map(_one_element, meta_args), **{k: _one_element(v) for k, v in meta_kwargs.items()})
        except (RuntimeError, NotImplementedError, TypeError):
            tiny = None                     # a CPU kernel missing for a dtype: the meta path decides
        if isinstance(tiny, torch.Tensor):
            return torch.empty(broadcast_shape(*shapes), dtype=tiny.dtype, device="meta")
    return func(*meta_args, **meta_kwargs)


_META = torch.device("meta")


def _on_meta_device(func, args: tuple, kwargs: dict) -> tuple:
    """The arguments with every ``device`` argument given as ``meta``."""
    for a in record(func).device_args:
        if not a.kwarg_only and a.index < len(args):
            if args[a.index] is not None:
                args = tuple(args[:a.index]) + (_META,) + tuple(args[a.index + 1:])
        elif kwargs.get(a.name) is not None:
            kwargs = dict(kwargs, **{a.name: _META})
    return args, kwargs


def _takes_shortcut(func) -> bool:
    """A pointwise op that writes no argument and returns one fresh tensor."""
    ok = _SHORTCUT.get(func)
    if ok is None:
        ok = _SHORTCUT[func] = torch.Tag.pointwise in func.tags and record(func).one_fresh_tensor
    return ok


def _has_tensor_lists(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v)
               for v in (*args, *kwargs.values()))


def _one_element(v):
    """A tensor as a one-element CPU tensor of its dtype and rank (ones: no division by zero)."""
    if isinstance(v, torch.Tensor):
        return torch.ones((1,) * v.dim(), dtype=v.dtype)
    return v
