"""Number arguments of a ``gt.compile``d function read by the graph at each call -- a clipping threshold --
rather than frozen into it.

A captured graph holds the numbers the capture met as constants, so a ``float`` argument keys the
graph by its value: a new value, a new capture. Where the number only sets a clipping threshold
(``clip_grad_norm_(params, max_norm)``, ``clip_grad_value_(params, clip_value)``), the graph can
read it at each call instead, as it reads the random counter: the capture passes each float
argument as a :class:`FedNumber`, and the clipping functions, given one, make their coefficient from
a 0-dim tensor the graph is fed with the argument's value at every call.

A ``FedNumber`` is no float. Every other use Python can see -- arithmetic, a comparison,
``float()``, formatting, a torch op it is passed to (which refuses it) -- marks it used, or fails;
then the function is captured again with plain floats, keyed by their values as before
(actor_rt/compiled.py). So a number is fed only where nothing but the clipping read it, and a graph
can never hold a stale copy of it.

The clipping computes what torch's does (torch/nn/utils/clip_grad.py, the same at every supported
release): ``max_norm / (total_norm + 1e-6)`` is ``(total_norm + 1e-6).reciprocal() * max_norm``, here
with the fed tensor in the norm's dtype for the number -- the same ops, so the same values.
"""
from __future__ import annotations

import functools
import torch
import torch.nn.utils as nn_utils
import torch.nn.utils.clip_grad as clip_grad
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support

from ..compat.dynamo import inlined_wrapper
from . import mapped_call


class FedNumber:
    """A float argument of a function being captured (its ``index`` among the call's leaves)."""
    __slots__ = ("value", "index", "used")

    def __init__(self, value: float, index: int):
        self.value, self.index, self.used = value, index, False

    def _read(self) -> float:
        self.used = True
        return self.value

    def tensor(self, dtype: torch.dtype, device) -> torch.Tensor:
        """The number as the graph's fed 0-dim tensor (a plain tensor outside a capture)."""
        capture = mapped_call._capture
        if capture is None:
            return torch.tensor(self.value, dtype=dtype, device=device)
        return capture.number(self, dtype, device)


def _reading(name: str):
    def method(self, *args):
        return getattr(self._read(), name)(*args)
    method.__name__ = name
    return method


for _name in ("__float__", "__int__", "__index__", "__bool__", "__round__", "__trunc__", "__floor__", "__ceil__",
              "__neg__", "__pos__", "__abs__", "__hash__", "__repr__", "__str__", "__format__",
              "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
              "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
              "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__pow__", "__rpow__", "__divmod__",
              "__rdivmod__"):
    setattr(FedNumber, _name, _reading(_name))


#: the wrappers' code: given a FedNumber, the library's clipping; else torch's, as Dynamo sees it too
_WRAPPERS = """
def clip_with_norm(parameters, max_norm, total_norm, foreach=None):
    if type(max_norm) is not FedNumber:
        return original(parameters, max_norm, total_norm, foreach)
    return fed(parameters, max_norm, total_norm, foreach)


def clip_to_value(parameters, clip_value, foreach=None):
    if type(clip_value) is not FedNumber:
        return original(parameters, clip_value, foreach)
    return fed(parameters, clip_value, foreach)
"""


def _fed_clip_with_norm(parameters, max_norm: FedNumber, total_norm, foreach=None) -> None:
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return
    with torch.no_grad():
        clip_coef = (total_norm + 1e-6).reciprocal() * max_norm.tensor(total_norm.dtype, total_norm.device)
        _scale(grads, torch.clamp(clip_coef, max=1.0), foreach)


def _scale(grads: list, coef: torch.Tensor, foreach) -> None:
    """Multiply the gradients by ``coef`` as torch's clipping does (foreach where it may; ``foreach=True``
    on a device without foreach kernels was refused already, by torch's norm before it)."""
    for (device, _), ([device_grads], _) in _group_tensors_by_device_and_dtype([grads]).items():
        if foreach or (foreach is None and _has_foreach_support(device_grads, device)):
            torch._foreach_mul_(device_grads, coef.to(device))
        else:
            for g in device_grads:
                g.mul_(coef.to(device))


def _fed_clip_value(parameters, clip_value: FedNumber, foreach=None) -> None:
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    bounds: dict = {}                   # one fed tensor per dtype and device
    with torch.no_grad():
        for g in [p.grad for p in parameters if p.grad is not None]:
            bound = bounds.get((g.dtype, g.device))
            if bound is None:
                bound = bounds[g.dtype, g.device] = clip_value.tensor(g.dtype, g.device)
            g.clamp_(min=-bound, max=bound)


def install_fed_numbers() -> None:
    """Wrap torch's clipping functions (once per process): given a FedNumber, they read the fed tensor."""
    if hasattr(clip_grad._clip_grads_with_norm_, "on_numbers"):
        return
    for name, code, fed in (("_clip_grads_with_norm_", "clip_with_norm", _fed_clip_with_norm),
                            ("clip_grad_value_", "clip_to_value", _fed_clip_value)):
        original = getattr(clip_grad, name)
        namespace = {"original": original, "fed": fed, "FedNumber": FedNumber}
        wrapped = functools.wraps(original)(inlined_wrapper(_WRAPPERS, code, namespace, f"torch's {name}"))
        wrapped.on_numbers = original
        setattr(clip_grad, name, wrapped)
        if getattr(nn_utils, name, None) is original:          # torch.nn.utils.clip_grad_value_
            setattr(nn_utils, name, wrapped)
