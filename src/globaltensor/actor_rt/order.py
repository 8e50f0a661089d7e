"""The reference order reworked so that what follows a collective waits until it is needed (lower.py
builds the order; every stream's static order is this order restricted to the stream)."""
from __future__ import annotations

import heapq
from typing import Dict, List, Optional

import torch

from ..ops.schema.op_record import record
from .program import CompileError, TaskSpec


def communication_first(tasks: List[TaskSpec], order: List[int], bounds: Optional[Dict[int, int]] = None) -> List[int]:
    """The reference order reworked so that what follows a collective waits until it is needed.

    In capture order, the ops that consume a collective's result come right after it (the
    gradient slices of a bucket's all-reduce); a stream running them there would sit waiting for
    the collective instead of going on with the backward. Each task downstream of a collective
    gets a deadline: the earliest position of anything that needs it (another collective, or a
    task that is not downstream of one) -- never later than its consumers. A topological sort by
    (deadline, the latest collective it waits for, position) then runs the work that feeds the
    next collective first, postpones the rest, and among what nothing waits for (an optimizer's
    updates) takes first what the earliest collectives made ready: the parameters of the first
    gradient bucket are updated while the last bucket is still being reduced. Collectives keep
    their positions, so every rank still issues them in capture order. ``bounds``: task id -> the
    latest position it may be postponed to (a pipeline schedule's units keep their order).
    """
    pos = {tid: p for p, tid in enumerate(order)}
    succ: Dict[int, List[int]] = {tid: [] for tid in order}
    preds: Dict[int, set] = {tid: set() for tid in order}
    for t in tasks:
        for x in t.inputs:
            if x[0] == "task":
                preds[t.id].add(x[1])
        preds[t.id].update(d for d, delay in t.deps if delay == 0)
        for p in preds[t.id]:
            succ[p].append(t.id)
    def is_collective(tid: int) -> bool:
        return tasks[tid].node is not None and tasks[tid].node.kind == "collective"
    downstream = set()
    for tid in order:
        if not is_collective(tid) and any(is_collective(p) or p in downstream for p in preds[tid]):
            downstream.add(tid)
    deadline: Dict[int, float] = {}
    for tid in reversed(order):
        if tid in downstream:
            deadline[tid] = min((deadline[c] for c in succ[tid]), default=float("inf"))
        else:
            deadline[tid] = pos[tid]
        if bounds is not None and tid in bounds:
            deadline[tid] = min(deadline[tid], bounds[tid])
    for tid in _views_feeding_collectives(tasks, order, preds, is_collective):
        deadline[tid] = -1
    gate: Dict[int, int] = {}                   # the latest collective it waits for (-1: none)
    for tid in order:
        gate[tid] = max([pos[tid] if is_collective(tid) else -1] + [gate[p] for p in preds[tid]])
    key = {tid: (deadline[tid], gate[tid], pos[tid], tid) for tid in order}
    waiting = {tid: len(preds[tid]) for tid in order}
    ready = [key[tid] for tid in order if not waiting[tid]]
    heapq.heapify(ready)
    out = []
    while ready:
        tid = heapq.heappop(ready)[-1]
        out.append(tid)
        for c in succ[tid]:
            waiting[c] -= 1
            if not waiting[c]:
                heapq.heappush(ready, key[c])
    if len(out) != len(order):
        raise CompileError("gt.compile: the captured graph has a cycle")
    return out


def _views_feeding_collectives(tasks: List[TaskSpec], order: List[int], preds: Dict[int, set], is_collective) -> set:
    """The tasks to run first: those whose only work is to make a view for a collective whose inputs
    need nothing else (the targets a loss all-gathers to count its global mean: a view of an
    argument). Run at their capture position, their collective would start only when the forward
    reaches the loss and hold the compute stream there; run first, it is done by then."""
    hoist = set()
    for tid in order:
        if not is_collective(tid):
            continue
        ancestors, todo, cheap = set(), list(preds[tid]), True
        while todo and cheap:
            a = todo.pop()
            if a in ancestors or is_collective(a):
                continue
            ancestors.add(a)
            cheap = _is_view(tasks[a].node)
            todo.extend(preds[a])
        if cheap:
            hoist |= ancestors
    return hoist


def _is_view(node) -> bool:
    """Whether ``node`` is an op whose results are views of its inputs (no data is computed)."""
    if node is None or node.kind == "collective" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    return record(node.target).is_view
