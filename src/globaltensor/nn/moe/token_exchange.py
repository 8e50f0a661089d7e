"""Rows to other ranks and back, in sizes the data decides: expert parallelism's all-to-all.

Each member of a group sends each other member some rows (the tokens routed to that member's
experts). The sizes are data, but a World's all-to-all needs every member's sizes on every
process: the members' counts are exchanged first (one small all-gather, counted like any
collective), then the rows move in one all-to-all. The exchange is differentiable: the backward
sends the rows' gradients back along the same routes, an all-to-all of the transposed sizes.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from ...comm import get_world
from ...observe.context import labelled

Matrix = List[List[int]]


@labelled("expert dispatch")
def exchange_counts(group: tuple, counts: Dict[int, torch.Tensor],
                    modelled: Optional[Dict[int, List[int]]] = None) -> Dict[int, List[int]]:
    """Every member's 1-D int64 ``counts`` (the same length everywhere), on every process:
    ``{rank: counts as a list}`` for each member of ``group``; ``counts`` holds the members this
    process holds. ``modelled``: meta counts, which carry no values -- the exchange runs (and is
    counted) and these are the answer."""
    world = get_world()
    n = len(next(iter(counts.values())))
    gathered = world.all_gather(group, {r: c.view(1, n) for r, c in counts.items()}, 0, [1] * len(group),
                                (len(group), n), torch.int64)
    if modelled is not None:
        return modelled
    rows = next(iter(gathered.values())).tolist()
    return dict(zip(group, rows))


def transposed(sizes: Matrix) -> Matrix:
    return [list(col) for col in zip(*sizes)]


@labelled("expert dispatch")
def _all_to_all(group: tuple, sizes: Matrix, sends: Dict[int, torch.Tensor]) -> Dict[int, torch.Tensor]:
    """Member i sends the next ``sizes[i][j]`` rows of its tensor to member j; each member gets the
    rows sent to it, concatenated in member order."""
    first = next(iter(sends.values()))
    row, dtype = tuple(first.shape[1:]), first.dtype
    members = range(len(group))
    chunks = {r: list(sends[r].split(sizes[i])) for i, r in enumerate(group) if r in sends}
    shapes = [[(sizes[i][j],) + row for j in members] for i in members]
    tiles = {}
    for j, r in enumerate(group):
        if r not in sends:
            continue
        starts = [sum(sizes[i][j] for i in range(k)) for k in members]
        tiles[r] = ((sum(sizes[i][j] for i in members),) + row,
                    [((0, starts[i], sizes[i][j]),) if sizes[i][j] else None for i in members])
    return get_world().all_to_all(group, chunks, shapes, dtype, tiles)


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, sizes, ranks, *sends):
        ctx.group, ctx.sizes, ctx.ranks = group, sizes, ranks
        ctx.shapes = [tuple(s.shape) for s in sends]
        ctx.dtype, ctx.devices = sends[0].dtype, [s.device for s in sends]
        got = _all_to_all(group, sizes, dict(zip(ranks, sends)))
        return tuple(got[r] for r in ranks)

    @staticmethod
    def backward(ctx, *grads):
        ready = {}
        for r, g, send_shape, device in zip(ctx.ranks, grads, ctx.shapes, ctx.devices):
            i = ctx.group.index(r)
            received = (sum(row[i] for row in ctx.sizes),) + send_shape[1:]
            ready[r] = g.contiguous() if g is not None else torch.zeros(received, dtype=ctx.dtype, device=device)
        back = _all_to_all(ctx.group, transposed(ctx.sizes), ready)
        return (None, None, None) + tuple(back[r] for r in ctx.ranks)


def exchange_rows(group: tuple, sizes: Matrix, sends: Dict[int, torch.Tensor]) -> Dict[int, torch.Tensor]:
    """The rows' all-to-all (``sizes[i][j]``: rows member i sends member j), differentiable."""
    ranks = tuple(r for r in group if r in sends)
    return dict(zip(ranks, _Exchange.apply(group, sizes, ranks, *(sends[r] for r in ranks))))
