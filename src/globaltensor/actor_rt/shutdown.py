"""Compiled graphs' stream threads stopped at the program's end, before the process world goes."""
from __future__ import annotations

import atexit
import weakref

import torch


_RUNNING: weakref.WeakSet = weakref.WeakSet()
_hooked = False


def stop_at_exit(runtime) -> None:
    """Stop ``runtime``'s threads when the program ends, before the process world destroys its groups.

    A stream thread of a CUDA graph holds its CUDA stream and may hold NCCL work; left running (a
    daemon thread) while the interpreter finalizes and the process groups are destroyed, it aborts
    the process ("terminate called without an active exception"). atexit runs the last registered
    hook first, and the first runtime starts after its world exists, so this runs before the
    world's shutdown: every thread is joined and the device synchronized."""
    global _hooked
    if not _hooked:
        _hooked = True
        atexit.register(_stop_all)
    _RUNNING.add(runtime)


def _stop_all() -> None:
    for runtime in list(_RUNNING):
        runtime.stop()
    _RUNNING.clear()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
