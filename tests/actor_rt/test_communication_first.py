"""The compute order a lowering gives around collectives (actor_rt/order.py ``communication_first``).

A collective whose inputs are views of the call's arguments (a loss's targets, all-gathered to count
its global mean) starts at the beginning of the call: the views are hoisted to the front of the
compute stream, so the forward does not stop at the loss to wait for it. Views that depend on
computed values, and computed inputs, stay where the capture put them.
"""
from __future__ import annotations

import torch

from globaltensor.actor_rt.graph import Node, Ref
from globaltensor.actor_rt.order import communication_first as _communication_first
from globaltensor.actor_rt.program import TaskSpec

aten = torch.ops.aten


def _op(tid: int, op, inputs: list) -> TaskSpec:
    refs = tuple(Ref(1000 + tid) for _ in inputs)
    node = Node(tid, "op", op, (refs + ((-1,),) if op is aten.view.default else refs, {}), [tid], None, str(op))
    return TaskSpec(tid, f"{tid}:{op}", node, None, 0, "r0:compute", inputs)


def _collective(tid: int, inputs: list) -> TaskSpec:
    node = Node(tid, "collective", "all_gather", ([], None), [tid], None, "all_gather")
    return TaskSpec(tid, f"{tid}:all_gather", node, None, 0, "r0:collective", inputs)


def _chain(n: int) -> list:
    """n relus, each of the one before (the first of argument 0)."""
    return [_op(i, aten.relu.default, [("feed", 0) if i == 0 else ("task", i - 1, 0)]) for i in range(n)]


def test_views_of_arguments_that_feed_a_collective_run_first():
    tasks = _chain(4) + [_op(4, aten.view.default, [("feed", 1)]),             # the targets, flattened
                         _collective(5, [("task", 4, 0)]),
                         _op(6, aten.add.Tensor, [("task", 3, 0), ("task", 5, 0)])]
    order = _communication_first(tasks, list(range(len(tasks))))
    assert order == [4, 0, 1, 2, 3, 5, 6], "the view first; the collective stream then starts with the call"


def test_computed_inputs_of_a_collective_keep_their_place():
    tasks = _chain(4) + [_op(4, aten.view.default, [("task", 2, 0)]),          # a view of a computed value
                         _collective(5, [("task", 4, 0)]),
                         _op(6, aten.add.Tensor, [("task", 3, 0), ("task", 5, 0)])]
    order = _communication_first(tasks, list(range(len(tasks))))
    assert order == [0, 1, 2, 3, 4, 5, 6]
