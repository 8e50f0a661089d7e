"""Errors of the communication layer, and the user-level call a collective runs for.

A collective that fails names its rank, op and group; when it runs inside one of the methods
that return a whole logical value (``numpy()``, ``item()``, ``full_tensor()``, ``tolist()``),
the message also says that every rank of the placement must call that method -- calling it
under ``if gt.rank() == 0`` is the usual way to get there.
"""
from __future__ import annotations

import threading


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the rank, the op, the group, the ranks
    that did not arrive and, inside a collective method, the method every rank must call."""


class ConsistencyError(ValueError):
    """The ranks disagree about an op or a boxing (``gt.set_check(True)``); raised on every rank,
    naming the op, the ranks that differ and what differs."""


class _Calling(threading.local):
    method = None      # "x.numpy()" while such a method runs on this thread
    placement = None


_calling = _Calling()


class collective_call:
    """``with collective_call("x.numpy()", placement):`` -- collectives failing inside say that
    every rank of ``placement`` must make this call."""

    __slots__ = ("method", "placement", "saved")

    def __init__(self, method: str, placement):
        self.method, self.placement = method, placement

    def __enter__(self):
        self.saved = (_calling.method, _calling.placement)
        if _calling.method is None:            # the outermost call is the one the user made
            _calling.method, _calling.placement = self.method, self.placement

    def __exit__(self, *exc):
        _calling.method, _calling.placement = self.saved


def calling_hint() -> str:
    """The hint for a collective failing now: the collective method it runs for, if any."""
    if _calling.method is None:
        return ""
    ranks = list(_calling.placement.rank_list()) if _calling.placement is not None else "of the world"
    return (f"; {_calling.method} is a collective: every rank of the placement {ranks} must call it "
            f"(not only some ranks, e.g. not inside `if gt.rank() == 0:`)")
