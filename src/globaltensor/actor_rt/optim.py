"""torch.optim optimizers inside a capture: their tensor ("capturable") form, and what freezes.

Adam, AdamW and their kin read the step counter on the host (``step.item()``) unless a group is
``capturable``; a host read would freeze the step into the graph. While a function is captured,
each optimizer stepped runs with ``capturable=True`` -- the same update in tensor ops (the bias
corrections computed as tensor ops on the step counter) -- and its step counter becomes a float64
tensor on its parameters' device, so the bias corrections keep the precision of the Python floats
the eager form computes them in (in float32, ``1 - 0.999 ** t`` loses about 1e-5 relative). torch limits the capturable form to accelerators by a device check; the
check is widened to the CPU for the capture only.

An elementwise optimizer over global parameters (nn/optim_pieces.py) is not flipped: its update is one
task of the graph that runs the plain update on the pieces at every replay, host reads included, and
reads the settings of its parameter group as they are then -- a learning-rate schedule needs no new
capture. Not so with ``cuda_graphs=True``: there the update is recorded op by op in its capturable
form, to be replayed inside the graphs. For those and the other optimizers, plain-number
hyper-parameters (``lr``, ``weight_decay``, betas) are frozen into the graph: the graph remembers
them, and a call after they changed captures again. A tensor ``lr`` is read by the graph on every
call and never causes a capture.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator, List

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import _disable_current_modes

from ..nn.optim_pieces import steps_on_pieces
from ..ops.schema.args import SCALARS



def hyper_parameters(optimizers: List[torch.optim.Optimizer], live: frozenset = frozenset()) -> tuple:
    """The plain-number settings of every group, to tell whether they changed since a capture; those in
    ``live`` (``(id(group), key)``: read by the graph at each run) are left out."""
    return tuple(tuple(sorted((k, v if type(v) in SCALARS else tuple(v) if isinstance(v, tuple) else None)
                              for k, v in group.items() if k != "params" and (id(group), k) not in live))
                 for opt in optimizers for group in opt.param_groups)


def live_keys(settings: tuple) -> frozenset:
    """``(id(group), key)`` of every setting a graph reads whole at each run: a number, or a tuple
    (betas) all of whose entries it reads."""
    read: dict = {}
    for group, key, index in settings:
        read.setdefault((id(group), key), (group, set()))[1].add(index)
    return frozenset(k for k, (group, indices) in read.items()
                     if indices == {None} or indices == set(range(len(group[k[1]]))))


def _with_cpu(original):
    def devices(*args, **kwargs):
        return list(original(*args, **kwargs)) + ["cpu"]
    return devices


@contextmanager
def capturable_optimizers(stepped: List[torch.optim.Optimizer], on_pieces: bool = True) -> Iterator[None]:
    """Within, every optimizer step runs in its capturable form -- but, with ``on_pieces``, an
    elementwise one over global parameters (recorded as one task: module docstring); ``stepped``
    collects the optimizers."""
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
        groups = [] if on_pieces and steps_on_pieces(opt) else \
            [g for g in opt.param_groups if g.get("capturable") is False]
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
