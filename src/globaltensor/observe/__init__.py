"""Observing what the library does: ``comm_profile`` (each collective with the op, module, phase and
conversion that caused it), the boxing and signature logs, their text and reports, and the
cross-rank consistency check (``gt.set_check``).

It sits above the worlds (it reads their byte counts, comm/stats.py) and below boxing and the ops,
which report to it."""
from .log import configure_from_environment, set_log_level
from .profile import CommEvent, CommProfile, Conversion, comm_profile

__all__ = ["comm_profile", "CommProfile", "CommEvent", "Conversion", "set_log_level"]

configure_from_environment()
