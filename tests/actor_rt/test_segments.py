"""The segment pass (actor_rt/segments.py): which runs of a compute stream's tasks a CUDA graph could
replay, and which break them -- on hand-made programs whose tasks claim a CUDA device (the pass reads
devices, it runs nothing), and on a compiled step of a CPU placement."""
from __future__ import annotations

from types import SimpleNamespace

import torch

import globaltensor as gt
from globaltensor.actor_rt.program import Program, TaskSpec
from globaltensor.actor_rt.segments import compute_stream, plan_segments
from nn_models import training_step

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def task(i, stream, inputs, device=CUDA, kind="op"):
    return TaskSpec(i, f"t{i}", SimpleNamespace(kind=kind, outs=[0]), None, 0, stream, inputs, device=device)


def program(tasks, returned=()):
    order = {}
    for t in tasks:
        order.setdefault(t.stream, []).append(t.id)
    outputs = [(None, {0: ("task", tid, 0)}) for tid in returned]
    return Program(tasks, order, outputs, [], [], [], {}, 1)


C, K = "r0:compute", "r0:collective"


def test_a_chain_on_the_gpu_is_one_segment():
    p = program([task(0, C, [("feed", "x")]), task(1, C, [("task", 0, 0), ("const", None)]),
                 task(2, C, [("task", 1, 0)])], returned=[2])
    (seg,) = plan_segments(p)
    assert seg.capturable and seg.tasks == [0, 1, 2]
    assert seg.inputs == [("feed", "x"), ("const", None)] and seg.outputs == [(2, 0)]


def test_cross_stream_edges_cut_the_stream():
    """t1's value goes to the collective (an event after t1); t3 reads the collective's (a wait before it)."""
    p = program([task(0, C, [("feed", "x")]), task(1, C, [("task", 0, 0)]),
                 task(2, K, [("task", 1, 0)], kind="collective"), task(3, C, [("task", 0, 0)]),
                 task(4, C, [("task", 2, 0), ("task", 3, 0)]), task(5, C, [("task", 4, 0)])], returned=[5])
    segs = plan_segments(p)
    assert [s.tasks for s in segs] == [[0, 1], [3], [4, 5]]
    assert all(s.capturable for s in segs)
    first, second, third = segs
    assert first.outputs == [(0, 0), (1, 0)]              # t0 read by t3 (another segment), t1 by the collective
    assert second.inputs == [("task", 0, 0)] and third.inputs == [("task", 2, 0), ("task", 3, 0)]


def test_a_task_on_the_cpu_is_a_segment_of_its_own_with_its_reason():
    p = program([task(0, C, [("feed", "x")]), task(1, C, [("task", 0, 0)], device=CPU),
                 task(2, C, [("task", 1, 0)]), task(3, C, [("task", 2, 0)])], returned=[3])
    segs = plan_segments(p)
    assert [s.tasks for s in segs] == [[0], [1], [2, 3]]
    assert [s.capturable for s in segs] == [True, False, True]
    assert segs[1].reason == "CPU tensors (t1)"


def test_a_collective_on_the_compute_stream_breaks_it():
    p = program([task(0, C, [("feed", "x")]), task(1, C, [("task", 0, 0)], kind="collective"),
                 task(2, C, [("feed", "y")])])
    segs = plan_segments(p)
    assert [s.tasks for s in segs] == [[0], [1], [2]]
    assert segs[1].reason.startswith("a collective (t1)")


def test_the_plan_of_a_cpu_step_shows_its_segments(p1):
    w = gt.distribute(torch.randn(6, 3), p1, gt.sbp.broadcast).requires_grad_()
    g = gt.compile(training_step(lambda x: (x @ w).pow(2).sum(), torch.optim.SGD([w], lr=0.1)))
    for _ in range(3):
        g(gt.distribute(torch.randn(8, 6), p1, gt.sbp.split(0)))
    plan = g.plan
    compute = [t for t in plan.tasks if compute_stream(t.stream)]       # the one shared stream "cpu"
    assert len(plan.segments) == len(compute) > 0
    assert not any(s.capturable for s in plan.segments)
    assert all(s.reason.startswith(("CPU tensors", "a collective")) for s in plan.segments
               if "SGD update on pieces" not in s.reason)
    assert [s.reason for s in plan.segments if s.reason.startswith("host code")] == [
        next(f"host code ({t.name})" for t in plan.tasks if "SGD update on pieces" in t.name)]
    assert f"compute segments: {len(compute)}, 0 capturable as CUDA graphs" in repr(plan)
