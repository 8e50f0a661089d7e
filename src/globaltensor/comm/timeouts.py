"""How long a collective waits for its peers: ``gt.set_timeout(seconds)``.

The default, 60 s, is what a user waiting at a terminal accepts for a collective whose peers
never come, and it is ample for peers that are merely slower; ``GT_COLLECTIVE_TIMEOUT`` in the
environment sets it for a job (a job with long one-rank phases, such as writing a checkpoint
from one rank, sets it higher). Every rank should set the same timeout.
"""
from __future__ import annotations

import math
import os
from datetime import timedelta

DEFAULT_S = 60.0


def _from_environment() -> float:
    text = os.environ.get("GT_COLLECTIVE_TIMEOUT")
    if text is None:
        return DEFAULT_S
    try:
        return _checked(float(text))
    except (TypeError, ValueError):
        raise ValueError(f"GT_COLLECTIVE_TIMEOUT: expected a positive number of seconds, got {text!r}") from None


def _checked(seconds) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (0 < seconds < math.inf):
        raise ValueError(f"set_timeout(seconds): expected a positive finite number of seconds, got {seconds!r}")
    return float(seconds)


_seconds = None


def timeout_s() -> float:
    """The collective timeout in seconds."""
    global _seconds
    if _seconds is None:
        _seconds = _from_environment()
    return _seconds


def collective_timeout() -> timedelta:
    return timedelta(seconds=timeout_s())


def set_timeout_s(seconds: float) -> float:
    """Set the timeout (validated); returns the previous one. ``gt.set_timeout`` also retimes the
    current world's groups (comm/current.py)."""
    global _seconds
    value = _checked(seconds)
    previous = timeout_s()
    _seconds = value
    return previous
