"""Logging of boxings and signature choices, through the ``logging`` module.

``GLOBALTENSOR_LOG=info`` (read when globaltensor is imported) or ``gt.set_log_level("info")``
logs each boxing as it runs -- the op it is for, the layouts, each collective with its group,
and the bytes -- on the logger ``globaltensor.boxing``; ``debug`` also logs each signature
choice with its cost on ``globaltensor.signature`` (once per op and input layouts: later calls
reuse the cached decision). Messages go to stderr through a handler added on the
``globaltensor`` logger, unless the application gave that logger a handler of its own.
"""
from __future__ import annotations

import logging
import os
from typing import Union

from .text import (conversion_text, group_text, op_name, placement_text, sbp_text, signature_text,
                           tensor_text)

LOGGER = logging.getLogger("globaltensor")
BOXING = logging.getLogger("globaltensor.boxing")
SIGNATURES = logging.getLogger("globaltensor.signature")

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
ENV = "GLOBALTENSOR_LOG"

on_level_change = []   # called after the level changed (the attribution switch follows it)


def set_log_level(level: Union[str, int, None]) -> None:
    """Set what globaltensor logs: ``"info"`` each boxing (layouts, collectives, bytes), ``"debug"``
    also each signature choice with its cost, ``"warning"`` (or None) neither.

    The same as the environment variable ``GLOBALTENSOR_LOG`` at import. Set the level through
    this function rather than on the logger itself: boxings are logged only while it says so,
    which keeps the hot path free of logging checks otherwise.
    """
    value = _level_value(level)
    LOGGER.setLevel(value)
    if value < logging.WARNING and not LOGGER.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
        LOGGER.addHandler(handler)
    for fn in on_level_change:
        fn()


def _level_value(level) -> int:
    if level is None:
        return logging.WARNING
    if isinstance(level, bool) or not isinstance(level, (str, int)):
        raise TypeError(f"set_log_level(level): expected one of {sorted(LEVELS)} or a logging level number, "
                        f"got {level!r}")
    if isinstance(level, int):
        return level
    value = LEVELS.get(level.strip().lower())
    if value is None:
        raise ValueError(f"set_log_level(level): expected one of {sorted(LEVELS)}, got {level!r}")
    return value


def boxings_logged() -> bool:
    return BOXING.isEnabledFor(logging.INFO)


def signatures_logged() -> bool:
    return SIGNATURES.isEnabledFor(logging.DEBUG)


def log_boxing(plan, op: str) -> None:
    """One INFO line for a boxing plan about to run: what for, the layouts, each step, the bytes."""
    src, dst = plan.src, plan.dst
    steps = "; ".join(_step_text(s) for s in plan.steps) or "nothing to do"
    where = f" on {placement_text(src.placement)}" if src.placement == dst.placement else ""
    BOXING.info("%s: %s %s%s: %s; %d B in all (the most any one rank sends)", op, tensor_text(src.shape, src.dtype),
                conversion_text(src.placement, src.nd_sbp, dst.placement, dst.nd_sbp), where, steps, plan.bytes)


def log_signature(func, in_layouts, chosen, candidates, cost) -> None:
    """One DEBUG line for a signature choice: the inputs, the chosen signature and its cost, and the
    other candidates with theirs, cheapest first. The cost is the cost model's: the bytes that box
    the inputs, plus for inputs autograd records those that bring their gradients back."""
    costs = sorted(((cost(c), i, c) for i, c in enumerate(candidates)), key=lambda x: (x[0], x[1]))
    others = ", ".join(f"{signature_text(c)} {k[0]} B" for k, _, c in costs if c != chosen)
    inputs = ", ".join(f"{tensor_text(l.shape, l.dtype)} {sbp_text(l.nd_sbp)}" for l in in_layouts)
    where = placement_text(in_layouts[0].placement) if in_layouts else "-"
    chosen_bytes, chosen_steps = cost(chosen)
    SIGNATURES.debug("%s(%s) on %s: chose %s, cost %d B (%d boxing step%s)%s", op_name(func), inputs, where,
                     signature_text(chosen), chosen_bytes, chosen_steps, "" if chosen_steps == 1 else "s",
                     f"; others: {others}" if others else "")


def _step_text(step) -> str:
    if step.is_collective:
        groups = " ".join(group_text(g) for g in step.groups if len(g) > 1)
        return f"{step.op} {groups} {step.bytes} B"
    return f"{step.op} (local)"


def configure_from_environment() -> None:
    value = os.environ.get(ENV, "").strip()
    if not value:
        return
    try:
        set_log_level(value)
    except (TypeError, ValueError):
        raise ValueError(f"{ENV}: expected one of {sorted(LEVELS)}, got {value!r}") from None
