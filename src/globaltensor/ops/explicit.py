"""``gt.explicit()``: every conversion an op would insert on its own becomes an error.

By default an op whose inputs are not in the layouts its chosen signature needs boxes them (the
dispatcher's conversions: an all-gather before a matmul, a plain tensor sliced to a split). Inside
``with gt.explicit():`` it raises instead, naming the op, its inputs' SBPs, the conversion it would
insert with its collectives and bytes, and the line to write -- ``x.to_global(sbp=...)`` -- so that
every collective of the program is one its source spells out. Conversions the user writes
(``to_global``) run as always; so do the library's own reductions (a gradient's, a kept optimizer
state's) and the backward pass, whose conversions are the transposes of the forward's.
Ops that no rule covers, gathered to broadcast by the fallback, are conversions too.
"""
from __future__ import annotations

import functools
from typing import List, Optional

import torch

from ..boxing import Layout, plan_boxing
from ..observe.where import user_frame
from ..sbp import broadcast
from ..sbp.text import sbp_text


class ImplicitBoxingError(RuntimeError):
    """Inside ``gt.explicit()``, an op would convert an input's layout by itself; the message names
    the op, its inputs' SBPs, the conversion and its bytes, and the ``to_global`` to write instead."""


class explicit:
    """``with gt.explicit():`` -- no op converts a layout by itself inside; nests; a decorator too."""

    depth = 0

    def __enter__(self) -> "explicit":
        explicit.depth += 1
        return self

    def __exit__(self, *exc) -> None:
        explicit.depth -= 1

    def __call__(self, fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with explicit():
                return fn(*args, **kwargs)
        return run


def refuse_implicit(func, sources: List[Optional[Layout]], targets: List[Layout]) -> None:
    """Raise :class:`ImplicitBoxingError` where an input (``sources``: a global tensor's layout, or
    None for a plain tensor, taken as broadcast) would be converted to its target -- inside
    ``gt.explicit()`` and outside autograd's backward pass."""
    if not explicit.depth or torch._C._current_graph_task_id() != -1:
        return
    for i, (source, target) in enumerate(zip(sources, targets)):
        plain = source is None
        start = target.with_sbp((broadcast,) * target.placement.ndim) if plain else source
        if start == target:
            continue
        plan = plan_boxing(start, target)
        moves = ", ".join(plan.collectives) or "no collective: a slice of each rank's copy"
        inputs = ", ".join("plain" if s is None else sbp_text(s.nd_sbp) for s in sources)
        what = "a plain tensor (taken as broadcast)" if plain else sbp_text(source.nd_sbp)
        line = f"gt.distribute(t, placement, {sbp_text(target.nd_sbp)})" if plain else \
            f"x.to_global(sbp={sbp_text(target.nd_sbp)})"
        raise ImplicitBoxingError(
            f"gt.explicit: {func} would convert its input {i} from {what} to {sbp_text(target.nd_sbp)} ({moves}; "
            f"{plan.bytes:,} bytes a rank) at {user_frame()}; its inputs are ({inputs}). Write the conversion: "
            f"{line} for that input, or run it outside gt.explicit()")


def refuse_fallback(func, sources: List[Layout]) -> None:
    """Raise inside ``gt.explicit()`` where the fallback would gather an op's inputs to broadcast."""
    if explicit.depth:
        refuse_implicit(func, sources, [s.with_sbp((broadcast,) * s.placement.ndim) for s in sources])
