"""Chains of views in a lowered program made one ``as_strided`` each.

A captured step is full of views of views: a gradient bucket's ``slice`` then ``view`` per parameter
(twice a step), ``t`` of ``t``, ``detach`` of a ``view``; on a simulated mesh of 64 ranks they are
most of the tens of thousands of tasks a step runs, each a full dispatch of a few microseconds.
Every iteration runs the same ops on tensors of the same shapes, so a view of a view of a tensor
``x`` has, every iteration, the sizes, strides and storage offset it had when captured: one
``as_strided(x, size, stride, offset)`` makes it. A view task whose input is another view task's
output is rewritten so; the inner view, when nothing else reads it, is left with no consumer, and
the runtime does not run it (stream_code.py).

Only ops that change nothing but the layout qualify (not ``conj``, ``view.dtype``, ``view_as_real``),
and only views of a task's output or of state: an argument may come with another storage offset
next call.
"""
from __future__ import annotations

from dataclasses import replace
from typing import List

from ..compat.torch_ops import MissingOp, aten
from .graph import Ref
from .program import TaskSpec

LAYOUT_VIEWS = frozenset(op for op in (
    aten.view.default, aten.t.default, aten.transpose.int, aten.permute.default, aten.slice.Tensor,
    aten.select.int, aten.expand.default, aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.alias.default, aten.detach.default, aten.as_strided.default, aten.narrow.default,
    aten.diagonal.default, aten._reshape_alias.default) if not isinstance(op, MissingOp))


IDENTITY_VIEWS = frozenset({aten.detach.default, aten.alias.default})


def is_layout_view(node) -> bool:
    return node is not None and node.kind == "op" and node.target in LAYOUT_VIEWS and node.out_slots is None


def fuse_views(tasks: List[TaskSpec], values: dict) -> None:
    """Rewrite, in place, every view task of a view task's output as one ``as_strided`` of the
    chain's root (``values``: the captured values, for the views' sizes, strides and offsets), and
    let every task read what an identity view (``detach``, ``alias``) of a task's output reads: in a
    graph that runs under ``no_grad`` the two tensors differ only as objects."""
    roots: dict = {}            # task id of a layout view -> (root source, root vid)
    same: dict = {}             # task id of an identity view of a task's output -> that output's source
    for t in tasks:             # producers come before their consumers
        t.inputs = [same.get(x[1], x) if x[0] == "task" and x[2] == 0 else x for x in t.inputs]
        n = t.node
        if is_layout_view(n) and n.target in IDENTITY_VIEWS and t.inputs and t.inputs[0][0] == "task":
            same[t.id] = t.inputs[0]
        if not is_layout_view(n) or not n.inputs:
            continue
        src, vid = t.inputs[0], n.inputs[0]
        if src[0] == "feed":
            continue
        inner = roots.get(src[1]) if src[0] == "task" else None
        roots[t.id] = inner if inner is not None else (src, vid)
        if inner is None:
            continue
        root_src, root_vid = inner
        shape, stride, offset, _ = values[n.outs[0]].meta
        t.node = replace(n, target=aten.as_strided.default, args=((Ref(root_vid), list(shape), list(stride), offset), {}),
                         inputs=(root_vid,), metas={root_vid: values[root_vid].meta})
        t.inputs = [root_src]


def without_dead_views(tasks: List[TaskSpec], order: List[int], refs: list) -> tuple:
    """``(tasks, order, remap)`` with the layout views nothing reads taken out (the inner views of
    chains :func:`fuse_views` rewrote, and then theirs), the others renumbered; ``refs`` holds the
    task ids the program's outputs need; ``remap(source)`` renumbers a ``("task", id, out)``."""
    readers: dict = {}
    for t in tasks:
        for x in t.inputs:
            if x[0] == "task":
                readers[x[1]] = readers.get(x[1], 0) + 1
    dead, work = set(), [t for t in reversed(tasks)]
    for t in work:                  # consumers before producers: a chain's views go one after another
        if is_layout_view(t.node) and not readers.get(t.id) and t.id not in refs:
            dead.add(t.id)
            for x in t.inputs:
                if x[0] == "task":
                    readers[x[1]] -= 1
    if not dead:
        return tasks, order, lambda src: src
    new_id = {}
    for t in tasks:
        if t.id not in dead:
            new_id[t.id] = len(new_id)

    def remap(src):
        return ("task", new_id[src[1]], src[2]) if src[0] == "task" else src
    kept = []
    for t in tasks:
        if t.id in dead:
            continue
        t.id, t.inputs = new_id[t.id], [remap(x) for x in t.inputs]
        t.deps = [(new_id[d], delay) for d, delay in t.deps if d not in dead]
        kept.append(t)
    return kept, [new_id[tid] for tid in order if tid not in dead], remap
