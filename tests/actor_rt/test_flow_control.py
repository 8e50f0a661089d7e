"""Credit-based flow control, checked on the recorded timeline of pipelines of many iterations.

With ``registers=k`` no producer runs more than ``k`` iterations ahead of its slowest consumer:
for every data edge P -> C of ``g.plan`` (C reads P's register), when P *starts* iteration i, C
has *finished* iteration i - k (P is about to overwrite the register C read then). The graphs
here have a cheap producer and an expensive consumer on another stream (a sleeping custom op),
so with broken credits the producer would run far ahead; that it does run ahead exactly as far
as the credits allow (a lead of k on the edge into the slow stage) shows the check has teeth.

The registers' memory, sampled with ``measure_memory=True``, stays within
``g.plan.memory_bound`` (sum of registers x output bytes), and more registers hold more memory.

A simulated CPU world runs its graph on one stream by default; these graphs ask for one stream
per rank (``streams="rank"``), so that producers and consumers meet across streams.
"""
from __future__ import annotations

import pytest
import torch

import globaltensor as gt
from runtime_helpers import (SLOW_S, assert_same, credit_violations, data_edges, max_lead, run_bounded,
                             timeline_of)

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
ITEMS = 12
HANG_S = 120
pytestmark = pytest.mark.timeout(300)

slow = torch.ops.gt_rt_helpers.slow


@pytest.fixture(autouse=True)
def _slow_consumer():
    previous = SLOW_S["seconds"]
    SLOW_S["seconds"] = 0.02
    yield
    SLOW_S["seconds"] = previous


def _two_stage(pa, pb):
    """Stage 1 (cheap, many small tasks) on ranks [0, 1]; stage 2 (a sleeping op) on [2, 3]."""
    w = gt.randn(8, 8, placement=pa, sbp=B)

    def fn(x):
        h = x
        for _ in range(3):
            h = torch.tanh(h @ w)
        h = h.to_global(placement=pb, sbp=S(0))
        return slow(h).to_global(sbp=B)
    return fn


def _run(g, xs, what="the pipeline"):
    """Warm up and capture on xs[0], then one pipeline of every x: its outputs and timeline."""
    g(xs[0])
    g(xs[0])
    assert g.captures == 1
    outs = run_bounded(lambda: g.pipeline(xs), HANG_S, what)
    return outs, timeline_of(g)


def _assert_credits(g, timeline):
    plan = g.plan
    fired = {name for _, name, _, _, _ in timeline}
    missing = [t.name for t in plan.tasks if t.name not in fired]
    assert not missing, f"tasks that never fired in the timeline: {missing}"
    assert len(timeline) == len(plan.tasks) * ITEMS, "every task fires once per iteration"
    bad = credit_violations(plan, timeline)
    assert not bad, f"{len(bad)} firings broke the credits, e.g.:\n" + "\n".join(bad[:10])


def _into_slow_stage(plan):
    """The cross-stream edges into stage 2: the stage boundary's transfer and what reads it."""
    edges = [(p, c) for p, c in data_edges(plan)
             if p.stream != c.stream and p.rank in (0, 1) and c.rank in (2, 3)]
    assert edges, f"no cross-stream edge into stage 2 in the plan:\n{plan}"
    return edges


@pytest.mark.parametrize("k", [1, 2, 3])
def test_no_producer_runs_more_than_k_ahead_across_stages(pa, pb, k):
    fn = _two_stage(pa, pb)
    xs = [gt.randn(8, 8, placement=pa, sbp=S(0)) for _ in range(ITEMS)]
    g = gt.compile(fn, registers=k, measure_memory=True, streams="rank", timeline=True)
    outs, timeline = _run(g, xs)
    assert all(t.registers == k for t in g.plan.tasks)
    _assert_credits(g, timeline)
    # the check has teeth: with the stage 2 consumer slow, the producer runs ahead as far as allowed
    leads = {(p.name, c.name): max_lead(timeline, p.name, c.name) for p, c in _into_slow_stage(g.plan)}
    assert max(leads.values()) == k, f"leads into the slow stage with {k} registers: {leads}"
    assert all(v <= k for v in leads.values()), leads
    for i, (x, out) in enumerate(zip(xs, outs)):
        assert_same(out, fn(x), f"item {i}")
    # the registers' memory stays within the plan's bound
    assert 0 < g.peak_register_bytes <= g.plan.memory_bound, \
        f"peak {g.peak_register_bytes} bytes, bound {g.plan.memory_bound}"


def test_per_task_register_counts_bound_each_producer(pa, pb):
    """registers= a function of the task: each producer is held to its own count."""
    def count(t):
        return 1 + t.id % 3
    fn = _two_stage(pa, pb)
    xs = [gt.randn(8, 8, placement=pa, sbp=S(0)) for _ in range(ITEMS)]
    g = gt.compile(fn, registers=count, measure_memory=True, streams="rank", timeline=True)
    outs, timeline = _run(g, xs)
    assert {t.name: t.registers for t in g.plan.tasks} == {t.name: count(t) for t in g.plan.tasks}
    assert len({t.registers for t in g.plan.tasks}) == 3
    _assert_credits(g, timeline)
    for p, c in _into_slow_stage(g.plan):
        lead = max_lead(timeline, p.name, c.name)
        assert lead <= p.registers, f"{p.name} ({p.registers} registers) ran {lead} ahead of {c.name}"
    for i, (x, out) in enumerate(zip(xs, outs)):
        assert_same(out, fn(x), f"item {i}")
    assert g.peak_register_bytes <= g.plan.memory_bound


def _stream_of(t):
    """The sleeping op and the all-gather after it on a "slow" stream, the rest on "main"."""
    slow_side = "gt_rt_helpers.slow" in t.name or (t.node is not None and t.node.kind == "collective")
    return f"r{t.rank}:slow" if slow_side else f"r{t.rank}:main"


@pytest.mark.parametrize("k", [1, 3])
def test_custom_streams_cheap_producer_expensive_consumer(p1, k):
    """streams=: a cheap producer and an expensive consumer of one rank on two streams."""
    w = gt.randn(6, 6, placement=p1, sbp=B)

    def fn(x):
        h = torch.sin(x @ w) * 2.0 + 1.0
        return slow(h).to_global(sbp=B)
    xs = [gt.randn(8, 6, placement=p1, sbp=S(0)) for _ in range(ITEMS)]
    g = gt.compile(fn, registers=k, streams=_stream_of, measure_memory=True, timeline=True)
    outs, timeline = _run(g, xs)
    plan = g.plan
    assert {t.name: t.stream for t in plan.tasks} == {t.name: _stream_of(t) for t in plan.tasks}, \
        f"gt.compile(streams=) was not applied:\n{plan}"
    assert {f"r{r}:slow" for r in range(4)} <= set(plan.streams), plan
    _assert_credits(g, timeline)
    into_slow = [(p, c) for p, c in data_edges(plan) if c.stream.endswith(":slow") and p.stream.endswith(":main")]
    assert len(into_slow) == 4, [(p.name, c.name) for p, c in into_slow]
    leads = {p.name: max_lead(timeline, p.name, c.name) for p, c in into_slow}
    assert max(leads.values()) == k and all(v <= k for v in leads.values()), leads
    for i, (x, out) in enumerate(zip(xs, outs)):
        assert_same(out, fn(x), f"item {i}")
    assert g.peak_register_bytes <= plan.memory_bound


def test_more_registers_hold_more_memory_within_the_bound(pa, pb):
    fn = _two_stage(pa, pb)
    xs = [gt.randn(8, 8, placement=pa, sbp=S(0)) for _ in range(ITEMS)]
    peaks, bounds = {}, {}
    for k in (1, 3):
        g = gt.compile(fn, registers=k, measure_memory=True, streams="rank")
        _run(g, xs)
        peaks[k], bounds[k] = g.peak_register_bytes, g.plan.memory_bound
        assert 0 < peaks[k] <= bounds[k], f"registers={k}: peak {peaks[k]} bytes, bound {bounds[k]}"
    assert bounds[3] == 3 * bounds[1]
    assert peaks[3] > peaks[1], f"peak register bytes: {peaks}"


def test_credits_and_memory_bound_in_a_data_parallel_training_pipeline(p1):
    """A training step (backward, bucketed gradient all-reduce on the collective stream, SGD),
    pipelined over calls: the credits hold on every edge, the memory within the bound."""
    w1 = gt.randn(6, 8, placement=p1, sbp=B).requires_grad_()
    w2 = gt.randn(8, 3, placement=p1, sbp=B).requires_grad_()
    opt = torch.optim.SGD([w1, w2], lr=0.05)

    def step(x, y):
        loss = ((torch.tanh(x @ w1) @ w2 - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    data = [(gt.randn(8, 6, placement=p1, sbp=S(0)), gt.randn(8, 3, placement=p1, sbp=S(0)))
            for _ in range(ITEMS)]
    for k in (1, 2):
        g = gt.compile(step, registers=k, measure_memory=True, streams="rank", timeline=True)
        g(*data[0])
        g(*data[0])
        run_bounded(lambda: g.pipeline(data), HANG_S, "the training pipeline")
        timeline = timeline_of(g)
        assert any(t.stream.endswith(":collective") for t in g.plan.tasks), g.plan
        _assert_credits(g, timeline)
        assert g.peak_register_bytes <= g.plan.memory_bound


def test_memory_bound_covers_registers_holding_views_of_arguments(p1):
    """A task whose output is a view of an argument's piece (x.t(), a slice) keeps the argument
    alive from its register; the measured peak must still be within the plan's bound."""
    def fn(x):
        return x.t()[:2].sum(0)
    xs = [gt.randn(64, 64, placement=p1, sbp=B) for _ in range(4)]
    g = gt.compile(fn, registers=1, measure_memory=True, warmup=0)
    run_bounded(lambda: g.pipeline(xs), HANG_S, "the pipeline")
    assert g.peak_register_bytes <= g.plan.memory_bound, \
        f"peak {g.peak_register_bytes} bytes > bound {g.plan.memory_bound}:\n" + \
        "\n".join(f"  {t.name}: {t.registers} x {t.nbytes} bytes" for t in g.plan.tasks)
