"""Running an op as its decomposition: PyTorch's core-ATen decomposition (or CompositeImplicitAutograd
kernel) called on the global tensors, its pieces dispatched again.

What runs is tracked per thread: an op met again inside its own decomposition falls back, and the
dispatcher costs the ops inside the decomposition of an op autograd records as recorded too
(:data:`decomposing`)."""
from __future__ import annotations

import threading
from collections import Counter

import torch
from torch.utils._pytree import tree_flatten

from ..fallback import run_fallback


class _Decomposing(threading.local):
    ops: set = None            # the ops whose decompositions are running
    recorded: int = 0          # how many of them autograd records


decomposing = _Decomposing()
decomposed_calls: Counter = Counter()   # calls per op that ran as its decomposition (the coverage table reads it)


def run_decomposition(func, decomposed, args, kwargs):
    """Dispatch the op's core-ATen decomposition; an op met again inside its own one falls back, and
    so does a random op whose decomposition returns a plain tensor: it drew its result with a
    factory that ignores the inputs' layout (``aten.uniform``, and torch 2.14's
    ``normal_functional``, draw ``normal(mean, std, self.shape)``); the fallback draws a global
    result whose replicas agree."""
    active = decomposing.ops
    if active is None:
        active = decomposing.ops = set()
    if func in active:
        return run_fallback(func, *tree_flatten((args, kwargs)))
    decomposed_calls[func] += 1
    recorded = int(torch.is_grad_enabled() and any(isinstance(v, torch.Tensor) and v.requires_grad
                                                   for v in tree_flatten((args, kwargs))[0]))
    active.add(func)
    decomposing.recorded += recorded
    try:
        out = decomposed(*args, **kwargs)
    finally:
        active.discard(func)
        decomposing.recorded -= recorded
    if torch.Tag.nondeterministic_seeded in func.tags and any(type(v) is torch.Tensor for v in tree_flatten(out)[0]):
        return run_fallback(func, *tree_flatten((args, kwargs)))
    return out
