"""Per-rank values combined over the ranks that split a reduced dim, in place: a kernel's partial
results made whole (a p-norm's local power sums, its local maxima).

:func:`combine_in_place` sums, or takes the maximum or minimum of, each held rank's value over the
rank's group (the ranks that differ only along the given placement axes), then applies ``finish``
(a p-norm's root), writing the result into the value it was given -- so a kernel can return its
local results at once and have them made whole after. Sums go by one all-reduce; maxima and minima
by an all-gather of the values (scalars, for a norm) and a local max or min, as the worlds reduce by
sum only.

Under :func:`batched` (a list op: ``_foreach_norm`` over a model's gradients) the values wait, and
the batch's end combines all of them that share a group, a kind, a dtype and a device type in one
collective: the norms of 21 gradients split over one placement cost one all-reduce of 21 scalars.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Dict, Optional

import torch

from ..boxing.layout import axis_groups
from ..comm import get_world
from ..placement import Placement

SUM, MAX, MIN = "sum", "max", "min"


class _Batch(threading.local):
    items: Optional[list] = None        # [(group, kind, values, finish)] waiting for the batch's end


_batch = _Batch()


@contextmanager
def batched():
    """Combine every value given inside in as few collectives as the groups, kinds and dtypes allow,
    at the end (nested: the outermost end)."""
    if _batch.items is not None:
        yield
        return
    _batch.items = []
    try:
        yield
        items = _batch.items
    finally:
        _batch.items = None
    _combine(items)


def combine_in_place(placement: Placement, axes: tuple, kind: str, values: Dict[int, torch.Tensor],
                     finish: Optional[Callable] = None) -> None:
    """Make each ``values[r]`` (a held rank's) the ``kind`` (:data:`SUM`, :data:`MAX`, :data:`MIN`) of
    its group's values along ``axes``, then ``finish`` of that -- now, or at the end of :func:`batched`."""
    world = get_world()
    items = [(group, kind, {r: values[r] for r in group if r in values}, finish)
             for group in axis_groups(placement, axes) if any(world.holds(r) for r in group)]
    if _batch.items is not None:
        _batch.items.extend(items)
    else:
        _combine(items)


def _combine(items: list) -> None:
    """One collective per (group, kind, dtype, device type) of ``items``, in first-seen order (every
    process sees the same)."""
    by_key: Dict[tuple, list] = {}
    for group, kind, values, finish in items:
        t = next(iter(values.values()))
        by_key.setdefault((group, kind, t.dtype, t.device.type), []).append((values, finish))
    for (group, kind, dtype, _), entries in by_key.items():
        held = list(entries[0][0])
        flat = {r: torch.cat([values[r].reshape(-1) for values, _ in entries]) for r in held}
        whole = _collective(group, kind, dtype, flat)
        for r in held:
            at = 0
            for values, finish in entries:
                v = values[r]
                part = whole[r][at:at + v.numel()].view(v.shape)
                at += v.numel()
                v.copy_(part if finish is None else finish(part))


def _collective(group: tuple, kind: str, dtype: torch.dtype, flat: Dict[int, torch.Tensor]) -> dict:
    world = get_world()
    if kind == SUM:
        return world.all_reduce(group, flat)
    n = next(iter(flat.values())).numel()
    gathered = world.all_gather(group, {r: t.unsqueeze(0) for r, t in flat.items()}, 0, [1] * len(group),
                                (len(group), n), dtype)
    return {r: t.amax(0) if kind == MAX else t.amin(0) for r, t in gathered.items()}
