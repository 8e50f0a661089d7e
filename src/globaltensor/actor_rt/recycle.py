"""Uninitialised memory handed out again: a compiled graph's ``empty`` tasks on CPU reuse their buffers.

A task whose op makes uninitialised memory (``empty``, ``empty_strided``, ``new_empty``: the flat
buffer of a gradient bucket, the result of a ``cat`` written part by part) asks for the same
bytes every iteration. glibc returns a freed block of many megabytes to the system (``munmap``,
or trimming the heap), and the next allocation faults every page in again: on the 2-process
data-parallel GPT at n_embd 512, the copies into the 25 MB gradient buckets faulted 6,000-12,000
pages in most steps. DDP keeps its buckets across steps for this reason.

So such a task keeps the tensors it made, at most one per register, and hands one out again
once nothing holds it any more: no Python reference besides its own, and no other tensor on its
storage (a view, a gradient made from it). Its memory then stays within what its registers
already account for. Only on CPU: a CUDA tensor may still be in use by a kernel queued on another
stream after its last reference is gone, and torch's caching allocator already reuses its memory.
"""
from __future__ import annotations

import sys
from collections import deque
from typing import Callable, Optional

import torch

from ..compat.storage import alone_on_storage
from ..compat.torch_ops import aten

EMPTY_LIKE_OPS = frozenset({aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
                            aten.new_empty_strided.default})


class Recycler:
    """Calls ``op`` (an empty-like op of one task, the same arguments every call), but first
    offers a CPU tensor it made before that nothing holds any more and that still has the shape
    and strides it was made with (an in-place op such as ``resize_`` or ``t_`` may have changed
    them); keeps the last ``keep``."""

    def __init__(self, op: Callable, keep: int):
        self.op = op
        self.pool: deque = deque(maxlen=keep)

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        for t, meta in self.pool:
            # unheld: referred to by the pool, ``t`` and getrefcount's argument only, and no other
            # tensor on its storage
            if sys.getrefcount(t) == 3 and alone_on_storage(t) and _meta(t) == meta:
                return t
        t = self.op(*args, **kwargs)
        if t.device.type == "cpu":
            self.pool.append((t, _meta(t)))
        return t


def _meta(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.storage_offset(), t.dtype


def recycled(target, keep: int) -> Optional[Recycler]:
    """A :class:`Recycler` for an empty-like op overload ``target``; None for any other op."""
    return Recycler(target._op, keep) if target in EMPTY_LIKE_OPS else None
