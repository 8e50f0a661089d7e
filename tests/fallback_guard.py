"""``no_fallback()``: a block in which an op running through the gather-to-broadcast fallback fails
(shared by the rule tests and the model tests)."""
from __future__ import annotations

import contextlib
import warnings

from globaltensor.ops import fallback


@contextlib.contextmanager
def no_fallback():
    """Fail on any op that runs through the fallback: its one-time warnings re-armed, as errors."""
    warned = fallback._warned
    fallback._warned = set()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="globaltensor: ")
            yield
    finally:
        fallback._warned = warned
