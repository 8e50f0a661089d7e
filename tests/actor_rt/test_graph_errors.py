"""An op that raises inside a compiled graph: the caller gets ``gt.GraphError`` within seconds,
naming the task's op and rank (the original exception chained), nothing hangs -- not the
streams waiting on the failed task, not producers waiting for credits, not collectives waiting
for the failed rank's input -- the failed graph's threads have ended when the error arrives, and
the compiled function captures again on its next call and computes the right values.

The failure comes from a custom op (``runtime_helpers.maybe_fail_op``, registered with
torch.library and given an SBP rule) that raises on pieces of a chosen number of rows while a
module-level flag is set: off during the warm-up and the capture, on during a graph run. An
uneven split picks which rank holds such a piece (7 rows over 4 ranks: 2, 2, 2, 1 -> rank 3).
"""
from __future__ import annotations

import time

import pytest
import torch

import globaltensor as gt
from globaltensor.comm.timeouts import timeout_s
from runtime_helpers import FAIL, SLOW_S, InjectedFailure, assert_same, run_bounded, set_failure, timeline_of

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
HANG_S = 60          # hang detection only
pytestmark = pytest.mark.timeout(300)

maybe_fail = torch.ops.gt_rt_helpers.maybe_fail
slow = torch.ops.gt_rt_helpers.slow
OP = "gt_rt_helpers.maybe_fail"


@pytest.fixture(autouse=True)
def _no_failure():
    set_failure(None)
    previous = SLOW_S["seconds"]
    SLOW_S["seconds"] = 0.005
    yield
    set_failure(None)
    SLOW_S["seconds"] = previous


def _runtime_threads(g) -> list:
    return [s.thread for s in g._graph().runtime.streams.values() if s.thread is not None]


def _expect_graph_error(call, rank: int, what: str) -> gt.GraphError:
    """``call()`` raises GraphError naming the op and ``rank``, promptly; the error."""
    start = time.perf_counter()
    with pytest.raises(gt.GraphError) as info:
        run_bounded(call, HANG_S, what)
    elapsed = time.perf_counter() - start
    msg = str(info.value)
    assert OP in msg, f"the error does not name the op: {msg}"
    assert f"rank {rank}" in msg, f"the error does not name rank {rank}: {msg}"
    assert "injected failure" in msg, f"the error does not carry the op's message: {msg}"
    assert isinstance(info.value.__cause__, InjectedFailure), repr(info.value.__cause__)
    assert elapsed < timeout_s(), f"the GraphError took {elapsed:.1f} s, not less than the collective timeout " \
        f"({timeout_s()} s): it waited for a peer"
    return info.value


def _assert_threads_end(threads: list) -> None:
    """The failed graph's threads have ended by the time its GraphError reaches the caller (none is
    left inside an op, which would abort the process if the error ended the program)."""
    for th in threads:
        assert not th.is_alive(), f"the failed graph's thread {th.name} is still running"


# -- one call --------------------------------------------------------------------------------------
CASES = {
    # placement ranks, sbp, rows, the rank holding the piece of `rows` rows
    "1d-rank3": ([0, 1, 2, 3], (S(0),), 7, 1, 3),
    "1d-rank0": ([0, 1, 2, 3], (S(0),), 5, 2, 0),
    "2x2-rank0": ([[0, 1], [2, 3]], (S(0), S(0)), 5, 2, 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_op_raising_in_the_graph_names_op_and_rank_then_recaptures(world4, case):
    ranks, sbp, rows, fail_rows, rank = CASES[case]
    p = gt.placement("cpu", ranks)
    bcast = (B,) * len(sbp)
    w = gt.randn(4, 4, placement=p, sbp=bcast)

    def fn(x):
        h = maybe_fail(torch.tanh(x @ w))
        return h.to_global(sbp=bcast) * 2.0
    x = gt.randn(rows, 4, placement=p, sbp=sbp)
    assert tuple(x.local_tensors()[rank].shape) == (fail_rows, 4)
    assert sum(t.shape[0] == fail_rows for t in x.local_tensors().values()) == 1
    ref = fn(x)

    g = gt.compile(fn)
    assert_same(g(x), ref, "warm-up")                  # flag off: warm-up (eager)
    assert_same(g(x), ref, "capture and first run")    # flag off: capture, graph run
    assert g.captures == 1
    threads = _runtime_threads(g)

    set_failure(rows=fail_rows)                        # flag on: the graph run fails
    err = _expect_graph_error(lambda: g(x), rank, "the failing call")
    assert f"@r{rank}" in str(err)
    _assert_threads_end(threads)

    set_failure(None)                                  # cleared: captures again, right values
    out = run_bounded(lambda: g(x), HANG_S, "the call after the failure")
    assert g.captures == 2, "the failed graph is dropped and captured again"
    assert_same(out, ref, "after the failure")
    x2 = gt.randn(rows, 4, placement=p, sbp=sbp)
    outs = run_bounded(lambda: g.pipeline([x2, x, x2]), HANG_S, "a pipeline after the failure")
    for i, (o, a) in enumerate(zip(outs, [x2, x, x2])):
        assert_same(o, fn(a), f"pipeline item {i} after the failure")
    assert g.captures == 2


def test_failing_again_after_a_recapture(p1):
    fn = lambda x: maybe_fail(x * 3.0).to_global(sbp=B)      # noqa: E731
    x = gt.randn(7, 3, placement=p1, sbp=S(0))
    g = gt.compile(fn, warmup=0)
    g(x)
    for attempt in range(3):
        set_failure(rows=1)
        _expect_graph_error(lambda: g(x), 3, f"failure {attempt}")
        set_failure(None)
        assert_same(run_bounded(lambda: g(x), HANG_S, "recapture"), fn(x), f"after failure {attempt}")
    assert g.captures == 4


# -- failures while other streams wait ---------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 3])
def test_failure_mid_pipeline_while_producers_wait_for_credits(pa, pb, k):
    """Stage 1 on [0, 1] runs ahead up to the credits; stage 2 on [2, 3] fails on its 5th
    iteration (rank 3's piece): stage 1, blocked on credits, and the stage 2 all-gather, blocked
    on rank 3, must both let go."""
    w = gt.randn(6, 6, placement=pa, sbp=B)

    def fn(x):
        h = torch.tanh(x @ w).to_global(placement=pb, sbp=S(0))
        return maybe_fail(slow(h)).to_global(sbp=B)
    xs = [gt.randn(3, 6, placement=pa, sbp=S(0)) for _ in range(12)]
    assert {r: t.shape[0] for r, t in xs[0].to_global(placement=pb, sbp=S(0)).local_tensors().items()} == {2: 2, 3: 1}
    g = gt.compile(fn, registers=k, streams="rank")
    g(xs[0])
    g(xs[0])
    threads = _runtime_threads(g)
    assert threads, "the graph runs on threads besides the caller's"
    set_failure(rows=1, after=4)
    _expect_graph_error(lambda: g.pipeline(xs), 3, "the failing pipeline")
    assert FAIL["calls"] == 5, "rank 3's piece failed on the 5th iteration"
    _assert_threads_end(threads)
    set_failure(None)
    outs = run_bounded(lambda: g.pipeline(xs), HANG_S, "the pipeline after the failure")
    assert g.captures == 2
    for i, (x, out) in enumerate(zip(xs, outs)):
        assert_same(out, fn(x), f"item {i}")


@pytest.mark.parametrize("fail_rank", [0, 3])
def test_failure_on_one_stream_while_other_streams_wait_on_it(p1, fail_rank):
    """streams=: the failing op alone on a stream of its rank; the rest of its rank, the other
    ranks and the all-gather read its result from other streams and wait on it."""
    def stream_of(t):
        return f"r{t.rank}:risky" if OP in t.name else f"r{t.rank}:main"
    w = gt.randn(5, 5, placement=p1, sbp=B)

    def fn(x):
        h = maybe_fail(torch.sin(x @ w))
        y = h.to_global(sbp=B)
        return torch.relu(y @ w) + h.sum()
    rows = 7 if fail_rank == 3 else 5                  # 2,2,2,1 / 2,1,1,1
    fail_rows = 1 if fail_rank == 3 else 2
    xs = [gt.randn(rows, 5, placement=p1, sbp=S(0)) for _ in range(6)]
    g = gt.compile(fn, registers=2, streams=stream_of)
    g(xs[0])
    g(xs[0])
    plan = g.plan
    assert f"r{fail_rank}:risky" in plan.streams, plan
    readers = [t for t in plan.tasks for src in t.inputs
               if src[0] == "task" and OP in plan.tasks[src[1]].name and t.stream != plan.tasks[src[1]].stream]
    assert readers, "something on another stream reads the failing op's output"
    threads = _runtime_threads(g)
    set_failure(rows=fail_rows, after=2)
    _expect_graph_error(lambda: g.pipeline(xs), fail_rank, "the failing pipeline")
    _assert_threads_end(threads)
    set_failure(None)
    outs = run_bounded(lambda: g.pipeline(xs), HANG_S, "the pipeline after the failure")
    for i, (x, out) in enumerate(zip(xs, outs)):
        assert_same(out, fn(x), f"item {i}")


def test_failure_in_a_training_step_leaves_state_usable(p1):
    """A failure in the forward of a compiled training step: a GraphError, and after it the
    function captures again and steps the parameters as eager steps would from their state."""
    w = gt.randn(4, 3, placement=p1, sbp=B).requires_grad_()
    opt = torch.optim.SGD([w], lr=0.1)

    def step(x, y):
        loss = ((maybe_fail(x @ w) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    x, y = gt.randn(7, 4, placement=p1, sbp=S(0)), gt.randn(7, 3, placement=p1, sbp=S(0))
    g = gt.compile(step)
    g(x, y)
    g(x, y)
    w_before = w.detach().full_tensor().clone()
    set_failure(rows=1)
    _expect_graph_error(lambda: g(x, y), 3, "the failing step")
    set_failure(None)
    assert torch.equal(w.detach().full_tensor(), w_before), "a step that failed in its forward updated w"
    loss = run_bounded(lambda: g(x, y), HANG_S, "the step after the failure")
    assert g.captures == 2
    # the eager step from the same parameters
    w_ref = w_before.clone().requires_grad_()
    xf, yf = x.full_tensor(), y.full_tensor()
    ref_loss = ((xf @ w_ref * 2.0 - yf) ** 2).mean()
    ref_loss.backward()
    torch.testing.assert_close(loss.full_tensor(), ref_loss.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w.detach().full_tensor(), (w_ref - 0.1 * w_ref.grad).detach(),
                               rtol=1e-12, atol=1e-12)


def test_the_timeline_shows_no_firing_past_the_failure(p1):
    """After a failure at iteration i of a task, no task downstream of it on its rank's stream
    fires iteration i or later: threads leave their loops rather than run on stale registers."""
    fn = lambda x: (maybe_fail(x + 1.0) * 2.0).to_global(sbp=B)     # noqa: E731
    xs = [gt.randn(7, 3, placement=p1, sbp=S(0)) for _ in range(8)]
    g = gt.compile(fn, registers=2, timeline=True)
    g(xs[0])
    g(xs[0])
    base = max(it for _, _, it, _, _ in timeline_of(g)) + 1       # the next run's first iteration
    rt = g._graph().runtime
    set_failure(rows=1, after=3)                                   # rank 3's 4th iteration fails
    _expect_graph_error(lambda: g.pipeline(xs), 3, "the failing pipeline")
    fired = {(name, it) for _, name, it, _, _ in rt.timeline}
    failing = next(t for t in rt.program.tasks if OP in t.name and t.rank == 3)
    assert {(failing.name, base + i) for i in range(3)} <= fired, "the first 3 iterations ran"
    assert not any(name == failing.name and it >= base + 3 for name, it in fired)
    downstream = [t for t in rt.program.tasks if any(src[0] == "task" and src[1] == failing.id for src in t.inputs)]
    assert downstream
    late = sorted((name, it) for name, it in fired if it >= base + 3 and name in {t.name for t in downstream})
    assert not late, f"tasks fired on the failed iteration's data: {late}"
