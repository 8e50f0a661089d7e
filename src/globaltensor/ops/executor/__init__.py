"""The executor: one runner for every kind of Decision (ops/decide/decision.py).

``runner(decision)`` gives the callable ``(args, kwargs) -> result`` that runs it, made once when
the decision is made and cached with it:

- ``local``: the op or the rule's kernel on each rank's pieces (local.py);
- ``list``: one call per group of elements (lists.py);
- ``inplace_view``, ``scalar_read``, ``decompose``, ``fallback``, ``write_back``, ``align``: the
  paths of writes/metadata_ops.py, scalar_read.py, the decomposition dispatched again, fallback.py,
  writes/written_inputs.py and align_placements.py.

A decision that makes a recorded input's gradient partial marks where that gradient is summed
(ops/gradient_sinks.py). What an op writes into a copy-view is then put back into its base, and a view op's result whose
pieces are copies remembers how it was made (writes/copy_views.py).
"""
from __future__ import annotations

from typing import Callable

from torch.utils._pytree import tree_flatten

from ..decide.decision import Decision
from ..align_placements import run_aligned
from ..fallback import run_fallback
from ..gradient_sinks import MarkRun
from ..scalar_read import read_scalar
from ..writes.written_inputs import write_back
from ..writes.metadata_ops import run_inplace_view
from ..writes.copy_views import ViewRun, WriteRun
from .decompose import run_decomposition
from .lists import ListRunner
from .local import PieceRun


_RUNNERS = {
    "local": lambda d: PieceRun(d).fast(),
    "list": ListRunner,
    "inplace_view": lambda d: lambda args, kwargs: run_inplace_view(d.func, args, kwargs),
    "scalar_read": lambda d: read_scalar,
    "decompose": lambda d: lambda args, kwargs: run_decomposition(d.func, d.decomposition, args, kwargs),
    "fallback": lambda d: lambda args, kwargs: run_fallback(d.func, *tree_flatten((args, kwargs))),
    "write_back": lambda d: lambda args, kwargs: write_back(d.func, args, kwargs),
    "align": lambda d: lambda args, kwargs: run_aligned(d.func, d.placement_to, args, kwargs),
}


def runner(d: Decision) -> Callable:
    """The callable running ``d``."""
    run = _RUNNERS[d.route](d)
    if d.marks:
        run = MarkRun(run, d.marks, d.placement)
    if d.written:
        return WriteRun(run, [d.positions[k] for k in d.written])
    if d.view_base is not None:
        return ViewRun(run, d.func, *d.view_base)
    return run
