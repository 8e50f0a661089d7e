"""What is running now -- the op, the boxing plan, another cause -- to attribute each collective to.

The op dispatcher, the boxing executor and a few callers that run collectives outside ops (a
gradient read that reduces, a gradient bucket, a compiled graph) report here, but only while
``on`` is true: a ``gt.comm_profile`` is open, or boxings are logged (``GLOBALTENSOR_LOG=info``).
Off, each of their hooks costs one boolean test.

The state is process-wide, not per thread: a compiled graph's stream threads run collectives for
the call that started them, and autograd may run a backward on a thread of its own.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from . import log as profile_log
from .text import op_name

on = False

_running: list = []       # innermost last: an op (an OpOverload) or a cause (label, phase)
_plans: list = []         # the boxing plans running, innermost last
_reentry = False          # the next dispatch call is within_op's own: it runs, unattributed again
_profiles = 0             # profiles open

TO_GLOBAL = "to_global"   # a collective outside any op and any other cause: a conversion the user asked for


def refresh() -> None:
    """Follow the profiles open and the log level."""
    global on
    on = _profiles > 0 or profile_log.boxings_logged()


profile_log.on_level_change.append(refresh)


def profile_opened() -> None:
    global _profiles
    _profiles += 1
    refresh()


def profile_closed() -> None:
    global _profiles
    _profiles -= 1
    refresh()


# -- the op dispatcher ---------------------------------------------------------------------------
def entering_op() -> bool:
    """Whether this dispatch call starts an op to attribute (False for the call within_op makes)."""
    global _reentry
    if _reentry:
        _reentry = False
        return False
    return True


def within_op(dispatch: Callable, cls, func, types, args, kwargs):
    """``dispatch(cls, func, types, args, kwargs)`` with ``func`` the op collectives are attributed to."""
    global _reentry
    _running.append(func)
    _reentry = True
    try:
        return dispatch(cls, func, types, args, kwargs)
    finally:
        _reentry = False
        _running.pop()


# -- the boxing executor -------------------------------------------------------------------------
def within_boxing(plan, run: Callable, pieces: dict, world):
    """``run(plan, pieces, world)`` with ``plan`` as the conversion that causes its collectives."""
    if profile_log.boxings_logged():
        profile_log.log_boxing(plan, current_label()[0])
    _plans.append(plan)
    try:
        return run(plan, pieces, world)
    finally:
        _plans.pop()


# -- other causes ----------------------------------------------------------------------------------
def run_labelled(label: str, fn: Callable, *args, phase: Optional[str] = None):
    """``fn(*args)``, its collectives attributed to ``label`` (and ``phase``, when given) unless an op
    or another cause within claims them."""
    if not on:
        return fn(*args)
    _running.append((label, phase))
    try:
        return fn(*args)
    finally:
        _running.pop()


def labelled(label: str, phase: Optional[str] = None) -> Callable:
    """Decorator form of :func:`run_labelled`."""
    def wrap(fn):
        @functools.wraps(fn)
        def run(*args):
            return run_labelled(label, fn, *args, phase=phase)
        return run
    return wrap


# -- reading ---------------------------------------------------------------------------------------
def current_label() -> tuple:
    """``(op label, phase)`` of what runs now: the innermost op or cause, else a to_global; the
    phase is "backward" inside autograd's backward, else "forward", unless the cause names one."""
    phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
    if not _running:
        return TO_GLOBAL, phase
    top = _running[-1]
    if type(top) is tuple:
        return top[0], top[1] or phase
    return op_name(top), phase


def current_plan():
    """The boxing plan running now, or None (a collective that no boxing plan issued)."""
    return _plans[-1] if _plans else None
