"""Seeing a layout: which rank holds which block of a 1-D or 2-D global tensor.

Drawn from the layout alone (no data moves): the tensor is cut at every piece boundary,
and each cell lists the ranks whose piece covers it; a partial-sum piece is marked ``P``
(the cell's value is the sum over the ranks listed). In the spirit of JAX's
``visualize_array_sharding``.
"""
from __future__ import annotations

import sys

from .boxing import Layout
from .tensor import GlobalTensor


def _cuts(layout: Layout, dim: int) -> list:
    n = layout.shape[dim]
    points = {0, n}
    for r in layout.placement.rank_list():
        for box, _ in layout.cells(r):
            s, length = box[dim]
            if length:
                points.update((s, s + length))
    return sorted(points)


def _holders(layout: Layout, cell: tuple) -> list:
    out = []
    for r in layout.placement.rank_list():
        if any(all(s <= c0 and c0 + cl <= s + length and length > 0 for (c0, cl), (s, length) in zip(cell, box))
               for box, _ in layout.cells(r)):
            out.append(r)
    return out


def _label(layout: Layout, ranks: list) -> str:
    mark = "P " if layout.has_partial else ""
    return mark + ",".join(str(r) for r in ranks) if ranks else "-"


def render_sharding(x, width: int = 72) -> str:
    """The picture as a string (``visualize`` prints it)."""
    layout = x.layout_meta if isinstance(x, GlobalTensor) else x
    if not isinstance(layout, Layout):
        raise TypeError(f"visualize: expected a global tensor, got {type(x).__name__}")
    if len(layout.shape) not in (1, 2):
        raise ValueError(f"visualize: expected a 1-D or 2-D tensor, got shape {tuple(layout.shape)}")
    as2d = layout if len(layout.shape) == 2 else None
    rows = _cuts(layout, 0) if as2d else [0, 1]
    cols = _cuts(layout, 1 if as2d else 0)
    grid = []
    for r0, r1 in zip(rows, rows[1:]):
        line = []
        for c0, c1 in zip(cols, cols[1:]):
            cell = ((r0, r1 - r0), (c0, c1 - c0)) if as2d else ((c0, c1 - c0),)
            line.append(_label(layout, _holders(layout, cell)))
        grid.append(line)
    if not grid or not grid[0]:
        return f"(empty tensor of shape {tuple(layout.shape)}) on {layout.placement}"
    cell_w = max(max(len(s) for line in grid for s in line) + 2, min(12, width // max(1, len(cols) - 1)))
    head = (f"shape {tuple(layout.shape)}  sbp {layout.nd_sbp}  placement {layout.placement.rank_list()}"
            f" {layout.placement.hierarchy}")
    border = "+" + "+".join("-" * cell_w for _ in grid[0]) + "+"
    body = [head, border]
    for (r0, r1), line in zip(zip(rows, rows[1:]), grid):
        span = f" rows {r0}:{r1}" if as2d else ""
        body.append("|" + "|".join(s.center(cell_w) for s in line) + "|" + span)
        body.append(border)
    body.append(" " + " ".join(f"{c0}:{c1}".center(cell_w) for c0, c1 in zip(cols, cols[1:])) + "  (columns)")
    return "\n".join(body)


def visualize(x, file=None) -> None:
    """Print which rank holds which block of ``x`` (partial pieces marked ``P``)."""
    print(render_sharding(x), file=file or sys.stdout)
