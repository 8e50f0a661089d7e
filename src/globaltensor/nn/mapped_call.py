"""One call of a ``gt.local_map`` function on one rank's pieces: run as it is eagerly; one opaque task
per rank (and one for its backward) in a graph ``gt.compile`` captures.

Eagerly the function's ops run, and autograd records them on the pieces. A captured graph could
record them op by op as well, but a mapped function is the escape hatch for code a graph should
not look into -- a custom kernel, a library call with launches of its own, ops the capture cannot
follow -- so the capture records each rank's call as one task whose target is the function: every
replay calls it on that rank's pieces. Its backward is a second task. The forward task keeps the
autograd graph of the call it made, keyed weakly by its first output (which the backward task
reads, so the two meet in the same iteration and micro-batch, and a graph whose output is dropped
goes with it), and the backward task runs ``torch.autograd.grad`` through it.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakTensorKeyDictionary

from ..placement import Placement


class _Running(threading.local):
    """The rank whose pieces a mapped function holds now, and its placement (per thread: a compiled
    graph runs ranks' tasks on several threads at once)."""
    rank: Optional[int] = None
    placement: Optional[Placement] = None


_running = _Running()
_capture = None         # the capture running now (actor_rt's Tracer): .task(target, tensors, writes=, settings=),
                        # .see(global tensor), .optimizer_tasks (nn/optim_pieces.py)


def running_rank() -> Optional[int]:
    """The rank a mapped function runs for now, or None outside one."""
    return _running.rank


def running_placement() -> Optional[Placement]:
    return _running.placement


@contextlib.contextmanager
def running_as(rank: int, placement: Placement):
    previous = _running.rank, _running.placement
    _running.rank, _running.placement = rank, placement
    try:
        yield
    finally:
        _running.rank, _running.placement = previous


def record_tasks_with(capture):
    """Install ``capture`` (or None): its ``task(target, tensors) -> outputs`` runs ``target`` on
    ``tensors`` and records it as one task; its ``see(t)`` is told of each global tensor read piece
    by piece. Returns the one it replaces."""
    global _capture
    previous, _capture = _capture, capture
    return previous


def note_read(t) -> None:
    """``t`` (a global tensor) is read piece by piece, outside any global op: a running capture must
    know it as it knows the arguments of global ops (a parameter's gradient is rebound by it)."""
    if _capture is not None:
        _capture.see(t)


def call_on_rank(fn: Callable, name: str, args: list, kwargs: dict, rank: int, placement: Placement):
    """``fn(*args, **kwargs)`` for ``rank``: directly, or recorded as one task while a capture runs."""
    if _capture is None:
        with running_as(rank, placement):
            return fn(*args, **kwargs)
    task = MappedTask(fn, name, args, kwargs, rank, placement)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        task.wants = tuple(t.requires_grad and (t.is_floating_point() or t.is_complex()) for t in tensors)
        outs = _Opaque.apply(task, *tensors)
    else:
        outs = _capture.task(task, tensors)
    return task.result(outs)


class MappedTask:
    """A mapped function on one rank's tensors, as a graph's task: called with the tensor arguments
    (the other arguments as the capture saw them), it returns the tensor results."""

    def __init__(self, fn: Callable, name: str, args: list, kwargs: dict, rank: int, placement: Placement):
        self.fn, self.name, self.kwargs, self.rank, self.placement = fn, name, kwargs, rank, placement
        self.holes = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        self.args = [None if i in self.holes else a for i, a in enumerate(args)]
        self.wants: tuple = ()                  # per tensor argument: whether its gradient is wanted
        self.graphs = WeakTensorKeyDictionary()  # first output -> (inputs, outputs) of the call's graph
        self.structure = None                   # the result's leaves and spec, as captured
        self.shapes: tuple = ()                 # the tensor results' shapes, as captured
        self.backward = _MappedBackward(self)

    def __str__(self) -> str:
        return f"local_map({self.name})"

    def __call__(self, *tensors: torch.Tensor) -> tuple:
        grad = any(self.wants)
        ins = [t.detach().requires_grad_() if want else t for t, want in zip(tensors, self.wants)] if grad \
            else list(tensors)
        args = list(self.args)
        for i, t in zip(self.holes, ins):
            args[i] = t
        with running_as(self.rank, self.placement), torch.set_grad_enabled(grad):
            result = self.fn(*args, **self.kwargs)
        leaves, spec = tree_flatten(result)
        outs = [o for o in leaves if isinstance(o, torch.Tensor)]
        shapes = tuple(tuple(o.shape) for o in outs)
        if self.structure is None:
            self.structure, self.shapes = (leaves, spec), shapes
        elif shapes != self.shapes:
            raise RuntimeError(f"local_map({self.name}): on rank {self.rank} the results' shapes are {list(shapes)}, "
                               f"captured as {list(self.shapes)}; a compiled graph keeps the layouts of the call it "
                               f"captured, so a mapped function's result shapes must not change from call to call")
        if not grad or not outs:
            return tuple(outs)
        returned = tuple(o.detach() for o in outs)
        self.graphs[returned[0]] = (ins, outs)
        return returned

    def result(self, outs: tuple):
        """The function's result with these tensors in its tensor places (its other values as captured)."""
        leaves, spec = self.structure
        it = iter(outs)
        return tree_unflatten([next(it) if isinstance(v, torch.Tensor) else v for v in leaves], spec)


class _MappedBackward:
    """The backward task of a :class:`MappedTask`: the gradients of its wanted inputs (zeros for an
    input the results do not depend on) from its first output and the results' gradients."""

    def __init__(self, task: MappedTask):
        self.task, self.rank = task, task.rank

    def __str__(self) -> str:
        return f"local_map({self.task.name}) (backward)"

    def __call__(self, first: torch.Tensor, *grads: torch.Tensor) -> tuple:
        ins, outs = self.task.graphs.pop(first)
        wanted = [t for t in ins if t.requires_grad]
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
        got = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True) \
            if pairs else [None] * len(wanted)
        return tuple(torch.zeros_like(t) if g is None else g for t, g in zip(wanted, got))


class _Opaque(torch.autograd.Function):
    """A recorded mapped call in the autograd graph of the capture: its backward is recorded as the
    task's backward task."""

    @staticmethod
    def forward(ctx, task: MappedTask, *tensors):
        outs = _capture.task(task, tensors)
        ctx.task, ctx.outs = task, [(o.shape, o.dtype, o.device) for o in outs]
        ctx.first = outs[0] if outs else None
        ctx.mark_non_differentiable(*[o for o in outs if not (o.is_floating_point() or o.is_complex())])
        return outs

    @staticmethod
    def backward(ctx, *grads):
        task = ctx.task
        if ctx.first is None:
            return (None,) + (None,) * len(task.wants)
        grads = [torch.zeros(shape, dtype=dtype, device=device) if g is None else g
                 for g, (shape, dtype, device) in zip(grads, ctx.outs)]
        got = iter(_capture.task(task.backward, (ctx.first, *grads)))
        return (None,) + tuple(next(got) if want else None for want in task.wants)
