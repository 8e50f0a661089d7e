"""torch.optim optimizers inside a capture: their tensor ("capturable") form, and what freezes.

Adam, AdamW and their kin read the step counter on the host (``step.item()``) unless a group is
``capturable``; a host read would freeze the step into the graph. While a function is captured,
each optimizer stepped runs with ``capturable=True`` -- the same update in tensor ops (the bias
corrections computed as tensor ops on the step counter) -- and its step counter becomes a float64
tensor on its parameters' device, so the bias corrections keep the precision of the Python floats
the eager form computes them in (in float32, ``1 - 0.999 ** t`` loses about 1e-5 relative). torch limits the capturable form to accelerators by a device check; the
check is widened to the CPU for the capture only.

Plain-number hyper-parameters (``lr``, ``weight_decay``, betas) are frozen into the graph: the
graph remembers them, and a call after they changed (a learning-rate scheduler's step) captures
again. A tensor ``lr`` is read by the graph on every call and never causes a capture.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator, List

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import _disable_current_modes

from ..ops.schema.args import SCALARS



def hyper_parameters(optimizers: List[torch.optim.Optimizer]) -> tuple:
    """The plain-number settings of every group, to tell whether they changed since a capture."""
    return tuple(tuple(sorted((k, v if type(v) in SCALARS else tuple(v) if isinstance(v, tuple) else None)
                              for k, v in group.items() if k != "params"))
                 for opt in optimizers for group in opt.param_groups)


def _with_cpu(original):
    def devices(*args, **kwargs):
        return list(original(*args, **kwargs)) + ["cpu"]
    return devices


@contextmanager
def capturable_optimizers(stepped: List[torch.optim.Optimizer]) -> Iterator[None]:
    """Within, every optimizer step runs in its capturable form; ``stepped`` collects the optimizers."""
    patched = []
    for name, module in list(sys.modules.items()):
        if name.startswith("torch.optim") and hasattr(module, "_get_capturable_supported_devices"):
            original = module._get_capturable_supported_devices
            patched.append((module, original))
            module._get_capturable_supported_devices = _with_cpu(original)
    flipped: list = []

    def before(opt, args, kwargs):
        if opt not in stepped:
            stepped.append(opt)
        groups = [g for g in opt.param_groups if g.get("capturable") is False]
        with _disable_current_modes():          # not part of the graph: the new counter is state
            for g in groups:
                g["capturable"] = True
                # a fused kernel reads its step counters as float32 (torch keeps them so); the others' in float64
                dtype = torch.float32 if g.get("fused") else torch.float64
                for p in g["params"]:
                    step = opt.state[p].get("step") if p in opt.state else None
                    if isinstance(step, torch.Tensor) and (step.device != p.device or step.dtype != dtype):
                        opt.state[p]["step"] = step.to(device=p.device, dtype=dtype)
        flipped.append(groups)

    def after(opt, args, kwargs):
        for g in flipped.pop():
            g["capturable"] = False

    handles = [register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for module, original in patched:
            module._get_capturable_supported_devices = original
