"""Take over a module that DTensor distributed (``parallelize_module``), and hand it back.

    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    gt.nn.from_dtensor_module(model)      # parameters and buffers: global tensors, same pieces
    y = model(x_global)                   # globaltensor's ops box by themselves
    gt.nn.to_dtensor_module(model)        # DTensor parameters again, its hooks back

``parallelize_module`` also installs forward hooks that turn a module's inputs and outputs
into DTensors of the plan's layouts; a global tensor needs none (every op infers its
layout), so :func:`from_dtensor_module` takes those hooks off (only the ones
``torch.distributed.tensor`` made) and keeps them on the module for :func:`to_dtensor_module`
to put back. Both convert in place, collectively (every rank calls them), and keep shared
parameters shared. An optimizer made before holds the former parameters: make it after.
"""
from __future__ import annotations

from typing import Optional

from torch import nn

from ..interop import from_dtensor, to_dtensor
from ..tensor import GlobalTensor

_KEPT_HOOKS = "_gt_dtensor_hooks"


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def _made_by_dtensor(hook) -> bool:
    code = getattr(hook, "__code__", None)
    return code is not None and "torch/distributed/tensor/" in code.co_filename.replace("\\", "/")


def _convert(module: nn.Module, wanted, convert) -> None:
    """Replace every parameter and buffer ``wanted(t)`` accepts by ``convert(t)``, shared ones once."""
    done = {}
    for mod in module.modules():
        for slots, is_param in ((mod._parameters, True), (mod._buffers, False)):
            for name, t in list(slots.items()):
                if t is None or not wanted(t):
                    continue
                new = done.get(id(t))
                if new is None:
                    value = convert(t.detach())
                    new = nn.Parameter(value, requires_grad=t.requires_grad) if is_param else value
                    done[id(t)] = new
                slots[name] = new


def from_dtensor_module(module: nn.Module) -> nn.Module:
    """Make every DTensor parameter and buffer of ``module`` a global tensor (``gt.from_dtensor``: the
    same pieces, shared where the layouts agree) and take off the input/output hooks DTensor's
    ``parallelize_module`` installed; in place, returns ``module``."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"from_dtensor_module: expected an nn.Module, got {type(module).__name__}")
    _convert(module, _is_dtensor, from_dtensor)
    for mod in module.modules():
        kept = []
        for kind, hooks in (("pre", mod._forward_pre_hooks), ("post", mod._forward_hooks)):
            for key, hook in list(hooks.items()):
                if _made_by_dtensor(hook):
                    del hooks[key]
                    kept.append((kind, hook))
        if kept:
            setattr(mod, _KEPT_HOOKS, getattr(mod, _KEPT_HOOKS, []) + kept)
    return module


def to_dtensor_module(module: nn.Module, mesh: Optional[object] = None) -> nn.Module:
    """Make every global parameter and buffer of ``module`` a DTensor (``x.to_dtensor(mesh)``) and put
    back the hooks :func:`from_dtensor_module` took off; in place, returns ``module``."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"to_dtensor_module: expected an nn.Module, got {type(module).__name__}")
    _convert(module, lambda t: isinstance(t, GlobalTensor), lambda t: to_dtensor(t, mesh))
    for mod in module.modules():
        for kind, hook in mod.__dict__.pop(_KEPT_HOOKS, []):
            (mod.register_forward_pre_hook if kind == "pre" else mod.register_forward_hook)(hook)
    return module
