"""Deadlock freedom: any stream assignment and any register counts run any graph to the end.

Hypothesis draws random DAGs of global-tensor ops on square shapes (each node combines one or
two earlier nodes: add, mul, mm, relu, sin, a transpose, an in-place update of a fresh tensor,
a to_global to a random SBP, a sum over a dim broadcast back, a round trip through another
placement), a register count per task (1-3, through a callable), a stream per task (one of three
names per rank, through a callable seeded by hypothesis) and a 1-D or 2x2 placement of the
4-rank simulated world. ``g.pipeline`` of a few inputs must finish (a deadlock fails the test
after a generous bound instead of hanging it), every item equals the eager call (float64), and
the recorded timeline keeps the credits.

Lowering's claim under test (lower.py): every stream follows the one reference order, so
"any assignment is deadlock-free".
"""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import globaltensor as gt
from runtime_helpers import assert_same, credit_violations, run_bounded, timeline_of

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
N = 6                      # square side: uneven pieces on 4 ranks (2, 2, 1, 1)
ITEMS = 3
HANG_S = 60
STREAM_NAMES = ("a", "b", "c")
pytestmark = pytest.mark.timeout(600)

SBP_1D = [S(0), S(1), B, P]
SBP_2D = [(a, b) for a in SBP_1D for b in SBP_1D]
UNARY = ["relu", "sin", "t", "inplace", "to_global", "sum_bcast", "roundtrip"]
BINARY = ["add", "mul", "mm"]


def _placements(kind: str):
    if kind == "1d":
        return gt.placement("cpu", [0, 1, 2, 3]), [gt.placement("cpu", [2, 3]), gt.placement("cpu", [3, 2, 1, 0])], SBP_1D
    return (gt.placement("cpu", [[0, 1], [2, 3]]),
            [gt.placement("cpu", [0, 1, 2, 3]), gt.placement("cpu", [[2, 3], [0, 1]])], SBP_2D)


@st.composite
def programs(draw):
    kind = draw(st.sampled_from(["1d", "2x2"]))
    n_sbp = len(SBP_1D) if kind == "1d" else len(SBP_2D)
    n = draw(st.integers(3, 15))
    nodes = []
    for i in range(n):
        earlier = 2 + i                          # the argument x, the state w, the nodes before
        op = draw(st.sampled_from(UNARY + BINARY))
        a = draw(st.integers(0, earlier - 1))
        b = draw(st.integers(0, earlier - 1)) if op in BINARY else None
        nodes.append(dict(op=op, a=a, b=b, sbp=draw(st.integers(0, n_sbp - 1)), dim=draw(st.integers(0, 1)),
                          other=draw(st.integers(0, 1)), back=draw(st.integers(0, n_sbp - 1))))
    extra = draw(st.lists(st.integers(2, 1 + n), max_size=2))      # more outputs besides the last node
    return dict(kind=kind, nodes=nodes, outputs=sorted(set(extra) | {1 + n}),
                x_sbp=draw(st.integers(0, n_sbp - 1)), w_sbp=draw(st.integers(0, n_sbp - 1)),
                registers=draw(st.lists(st.integers(1, 3), min_size=1, max_size=5)),
                stream_seed=draw(st.integers(0, 2 ** 16)))


def build(prog, w, others, sbps):
    """The function of a drawn program: fn(x) -> a tuple of global tensors."""
    def fn(x):
        vals = [x, w]
        for nd in prog["nodes"]:
            a = vals[nd["a"]]
            op = nd["op"]
            if op == "relu":
                v = torch.relu(a)
            elif op == "sin":
                v = torch.sin(a)
            elif op == "t":
                v = a.t()
            elif op == "inplace":
                v = a * 0.5
                v.add_(1.0)
            elif op == "to_global":
                v = a.to_global(sbp=sbps[nd["sbp"]])
            elif op == "sum_bcast":
                v = a.sum(nd["dim"], keepdim=True).expand(N, N) / N
            elif op == "roundtrip":
                q = others[nd["other"]]
                there = SBP_1D[nd["sbp"] % len(SBP_1D)] if q.ndim == 1 else SBP_2D[nd["sbp"] % len(SBP_2D)]
                v = a.to_global(placement=q, sbp=there)
                v = (v * 1.5).to_global(placement=a.placement, sbp=sbps[nd["back"]])
            elif op == "add":
                v = a + vals[nd["b"]]
            elif op == "mul":
                v = a * vals[nd["b"]]
            else:
                v = (a @ vals[nd["b"]]) / N
            vals.append(v)
        return tuple(vals[i] for i in prog["outputs"])
    return fn


@settings(max_examples=200, deadline=None, derandomize=False,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(prog=programs())
def test_random_graphs_any_streams_and_registers_finish_and_equal_eager(world4, prog):
    p, others, sbps = _placements(prog["kind"])
    ks = prog["registers"]
    rng_seed = prog["stream_seed"]

    def registers(t):
        return ks[t.id % len(ks)]

    def streams(t):
        return f"r{t.rank}:{random.Random(rng_seed * 7919 + t.id).choice(STREAM_NAMES)}"
    gt.manual_seed(rng_seed)
    w = gt.randn(N, N, placement=p, sbp=sbps[prog["w_sbp"]])
    xs = [gt.randn(N, N, placement=p, sbp=sbps[prog["x_sbp"]]) for _ in range(ITEMS)]
    fn = build(prog, w, others, sbps)
    refs = [fn(x) for x in xs]

    g = gt.compile(fn, registers=registers, streams=streams, warmup=0, timeline=True)
    outs = run_bounded(lambda: g.pipeline(xs), HANG_S, f"g.pipeline of {ITEMS} items")

    plan = g.plan
    assert {t.name: t.registers for t in plan.tasks} == {t.name: registers(t) for t in plan.tasks}
    wrong = [(t.name, t.stream, streams(t)) for t in plan.tasks if t.stream != streams(t)]
    assert not wrong, f"gt.compile(streams=) not applied to {len(wrong)} tasks, e.g. {wrong[:3]}"
    assert g.captures == 1
    assert len(outs) == ITEMS
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert len(out) == len(ref)
        for j, (o, r) in enumerate(zip(out, ref)):
            assert_same(o, r, f"item {i}, output {j}")
    bad = credit_violations(plan, timeline_of(g))
    assert not bad, "\n".join(bad[:5])

    # the same graph again, a second pipeline over the running threads
    again = run_bounded(lambda: g.pipeline(xs[::-1]), HANG_S, "a second pipeline")
    for i, (out, ref) in enumerate(zip(again, refs[::-1])):
        for j, (o, r) in enumerate(zip(out, ref)):
            assert_same(o, r, f"second pipeline, item {i}, output {j}")
    assert g.captures == 1


@pytest.mark.parametrize("k", [1, 2, 3])
def test_every_task_on_its_own_stream(p1, k):
    """The extreme assignment: one stream per task (every edge crosses threads)."""
    w = gt.randn(N, N, placement=p1, sbp=S(1))

    def fn(x):
        h = torch.relu(x @ w).to_global(sbp=B)
        return (h * h.sum(0, keepdim=True)).to_global(sbp=S(1)), h.to_global(sbp=P)
    xs = [gt.randn(N, N, placement=p1, sbp=S(0)) for _ in range(5)]
    g = gt.compile(fn, registers=k, streams=lambda t: f"r{t.rank}:t{t.id}", warmup=0, timeline=True)
    outs = run_bounded(lambda: g.pipeline(xs), HANG_S, "a pipeline with a stream per task")
    assert len(g.plan.streams) == len(g.plan.tasks), g.plan
    for i, (x, out) in enumerate(zip(xs, outs)):
        for j, (o, r) in enumerate(zip(out, fn(x))):
            assert_same(o, r, f"item {i}, output {j}")
    assert not credit_violations(g.plan, timeline_of(g))


def test_collectives_and_compute_on_one_stream_per_rank(p2):
    """The other extreme: a single stream per rank, collectives included (a collective of a
    simulated world runs on its lowest member's stream, between that rank's compute tasks)."""
    w = gt.randn(N, N, placement=p2, sbp=(B, S(1)))

    def fn(x):
        h = (x @ w).to_global(sbp=(S(0), B))
        return torch.sin(h).to_global(sbp=(B, B)) + h.to_global(placement=gt.placement("cpu", [3, 2, 1, 0]),
                                                                   sbp=S(1)).to_global(placement=p2, sbp=(B, B))
    xs = [gt.randn(N, N, placement=p2, sbp=(S(0), S(1))) for _ in range(5)]
    g = gt.compile(fn, registers=1, streams=lambda t: f"r{t.rank}:only", warmup=0)
    outs = run_bounded(lambda: g.pipeline(xs), HANG_S, "a pipeline with one stream per rank")
    assert set(g.plan.streams) == {f"r{r}:only" for r in range(4)}, g.plan
    for i, (x, out) in enumerate(zip(xs, outs)):
        assert_same(out, fn(x), f"item {i}")
