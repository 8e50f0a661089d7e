"""gt.comm_profile: each collective attributed to its op, module, phase and conversion; the
profile's rows add up to gt.comm_stats() over the same region, rank by rank."""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.distributed._tools.mod_tracker import ModTracker

import globaltensor as gt
from globaltensor.boxing import plan_boxing
from globaltensor.comm import stats
from globaltensor.observe import context as profile_context

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import TENSOR_PARALLEL, GPT, GPTConfig, make_batch  # noqa: E402

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)


class _ParentsAtEachCollective(stats.CommStats):
    """A recorder noting torch's ModTracker's view (the modules running) at each collective."""

    def __init__(self, tracker: ModTracker):
        super().__init__()
        self.tracker = tracker
        self.parents = []

    def add(self, record):
        super().add(record)
        self.parents.append(set(self.tracker.parents))


@pytest.fixture(scope="module")
def gpt_step():
    """One hybrid-parallel GPT training step (TP on axis 1, DP on axis 0, AdamW, the loss read),
    inside gt.comm_stats(), gt.comm_profile(model) and torch's ModTracker."""
    with gt.simulate(4):
        torch.manual_seed(0)
        model = GPT(CFG)
        p = gt.placement("cpu", [[0, 1], [2, 3]])
        gt.nn.distribute_module(model, p, gt.nn.megatron_plan(**TENSOR_PARALLEL, axis=1, ndim=2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        idx, targets = make_batch(CFG, 4, CFG.block_size, torch.Generator().manual_seed(0))
        idx, targets = (gt.distribute(t, p, (S(0), B)) for t in (idx, targets))
        with ModTracker() as tracker:
            oracle = _ParentsAtEachCollective(tracker)
            stats.start_recording(oracle)
            try:
                with gt.comm_stats() as st, gt.comm_profile(model) as prof:
                    loss = model.loss(idx, targets)
                    loss.backward()
                    opt.step()
                    loss.item()
            finally:
                stats.stop_recording(oracle)
    return st, prof, oracle


@pytest.mark.parametrize("by", [("op",), ("module",), ("op", "module", "phase", "collective", "group", "conversion"),
                                ("conversion",)])
def test_rows_add_up_to_comm_stats_rank_by_rank(gpt_step, by):
    st, prof, _ = gpt_step
    rows = prof.rows(by)
    summed = Counter()
    for row in rows:
        summed.update(row["bytes_per_rank"])
        assert row["bytes"] == max(row["bytes_per_rank"].values())
    assert dict(summed) == {r: b for r, b in st.per_rank.items()}
    assert sum(row["calls"] for row in rows) == st.count == len(prof.events) > 10      # a whole step's worth
    assert prof.bytes_sent == st.bytes_sent and dict(prof.per_rank) == dict(st.per_rank)
    assert Counter(e.collective for e in prof.events) == Counter(st.ops())


def test_modules_agree_with_torch_mod_tracker(gpt_step):
    """Forward and backward: the profile's module is the deepest that torch's ModTracker sees running."""
    _, prof, oracle = gpt_step
    assert len(oracle.parents) == len(prof.events)
    depth = lambda name: name.count(".")
    phases = Counter()
    for event, parents in zip(prof.events, oracle.parents):
        deepest = max(depth(n) for n in parents)
        assert event.module in parents and depth(event.module) == deepest, (event, parents)
        if event.module != "Global":
            phases[event.phase] += 1
    assert phases["forward"] > 0 and phases["backward"] > 0    # module collectives in both passes


def test_gpt_step_has_the_expected_causes(gpt_step):
    _, prof, _ = gpt_step
    by_op = {row["op"]: row for row in prof.rows(("op",))}
    assert {"gradient bucket", "to_global"} <= set(by_op)           # the backward's buckets; loss.item()
    assert any(op.startswith("aten.") for op in by_op)
    boxings = [e for e in prof.events if e.op != "gradient bucket"]
    assert all(e.conversion is not None for e in boxings)           # every other collective comes from a boxing
    assert all(e.conversion is None and e.phase == "backward" for e in prof.events if e.op == "gradient bucket")
    assert all(e.op.startswith("aten.") for e in boxings if e.phase == "backward")


def test_ops_conversions_and_bytes_of_known_boxings(p1):
    x = gt.randn(8, 6, placement=p1, sbp=S(1), requires_grad=True)
    w = gt.randn(6, 4, placement=p1, sbp=S(1))
    with gt.comm_stats() as st, gt.comm_profile() as prof:
        y = x @ w                          # mm picks (S(1), S(0)) -> P: w all-to-all'ed S(1) -> S(0)
        z = y.to_global(sbp=B)             # P -> B: all-reduce
        z.sum().backward()                 # backward of the to_global: B -> B, nothing; x's gradient: partial
        gx = x.grad                        # reading it reduce-scatters it to x's S(1)
    plans = [gt.boxing_plan(w, sbp=S(0)), gt.boxing_plan(y, sbp=B),
             plan_boxing(x.layout_meta.with_sbp((P,)), x.layout_meta)]
    got = [(e.op, e.module, e.phase, e.collective, e.group, str(e.conversion), e.conversion.tensor)
           for e in prof.events]
    assert got == [("aten.mm", "Global", "forward", "all_to_all", (0, 1, 2, 3), "S(1) -> S(0)", "6x4 float32"),
                   ("to_global", "Global", "forward", "all_reduce", (0, 1, 2, 3), "P -> B", "8x4 float32"),
                   ("grad read", "Global", "forward", "reduce_scatter", (0, 1, 2, 3), "P -> S(1)", "8x6 float32")]
    assert [e.bytes_per_rank for e in prof.events] == [p.bytes_per_rank for p in plans]
    assert prof.per_rank == st.per_rank and gx.sbp == (S(1),)


def test_backward_of_a_to_global(p1):
    x = gt.randn(8, 6, placement=p1, sbp=B, requires_grad=True)
    w = gt.randn(8, 6, placement=p1, sbp=S(0), requires_grad=True)
    with gt.comm_profile() as prof:
        s = x.to_global(sbp=S(0))          # B -> S(0): a slice; its backward all-gathers the gradient
        (s * w).sum().backward()
    assert [(e.op, e.phase, e.collective, str(e.conversion)) for e in prof.events] == [
        ("to_global", "backward", "all_gather", "S(0) -> B")]


def test_grad_read_is_attributed(p1):
    w = gt.randn(6, 4, placement=p1, sbp=B, requires_grad=True)
    x = gt.randn(8, 6, placement=p1, sbp=S(0))
    (x @ w).sum().backward()               # w's gradient accumulates partial
    with gt.comm_profile() as prof:
        g = w.grad
    assert [(e.op, e.collective, str(e.conversion), e.conversion.tensor) for e in prof.events] == [
        ("grad read", "all_reduce", "P -> B", "6x4 float32")]
    assert g.sbp == (B,)


def test_moves_between_placements_and_nd_boxing(p2):
    sub = gt.placement("cpu", [1, 2])
    x = gt.randn(7, 6, placement=p2, sbp=(S(0), S(1)))
    with gt.comm_stats() as st, gt.comm_profile() as prof:
        b = x.to_global(sbp=(B, B))
        m = b.to_global(placement=sub, sbp=S(0))
        m.to_global(placement=gt.placement("cpu", [0, 1, 2, 3]), sbp=B)
    assert sum((Counter(r["bytes_per_rank"]) for r in prof.rows()), Counter()) == Counter(st.per_rank)
    texts = {str(e.conversion) for e in prof.events}
    assert "(S(0), S(1)) -> (B, B)" in texts
    assert any(" on cpu[1,2] -> B on cpu[0,1,2,3]" in t for t in texts)
    assert len({e.conversion for e in prof.events if e.conversion.src_sbp == (S(0), S(1))}) == 1


def test_nested_profiles_and_nothing_left_after_exit(world4):
    model = torch.nn.Linear(4, 4)
    p = gt.placement("cpu", [0, 1, 2, 3])
    gt.nn.distribute_module(model, p, {"weight": S(0)})
    x = gt.randn(2, 4, placement=p, sbp=B)
    with gt.comm_profile(model) as outer:
        with gt.comm_profile(model) as inner:
            model(x).to_global(sbp=B)
        model(x).to_global(sbp=B)
    assert len(inner.events) == 1 and len(outer.events) == 2
    assert inner.events[0].module == outer.events[0].module == "Global"
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert profile_context.on is False
    with gt.comm_stats() as st:
        model(x).to_global(sbp=B)
    assert st.count == 1 and len(outer.events) == 2


def test_module_forward_collective_attributed(world4):
    class Gather(torch.nn.Module):
        def forward(self, x):
            return x.to_global(sbp=B)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Sequential(torch.nn.Identity(), Gather())

        def forward(self, x):
            return self.inner(x) * 2

    p = gt.placement("cpu", [0, 1, 2, 3])
    net = Net()
    x = gt.randn(8, 3, placement=p, sbp=S(0))
    with gt.comm_profile(net) as prof:
        net(x)
    assert [(e.module, e.op, e.phase) for e in prof.events] == [("Net.inner.1", "to_global", "forward")]
    assert prof.module_types["Net.inner.1"] == "Gather"


def test_compiled_function(p1):
    """The warm-up call is eager (causes attributed); the capture's collectives are kept apart as
    ``captured``, attributed alike; each call the graph runs issues them again, as gt.compile graph."""
    gt.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 6))
    gt.nn.distribute_module(model, p1, {})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        loss = (model(x) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    compiled = gt.compile(step)
    x = gt.randn(8, 6, placement=p1, sbp=S(0))
    calls = 4
    with gt.comm_stats() as st, gt.comm_profile(model) as prof:
        for _ in range(calls):
            compiled(x)
    graph_calls = calls - 1              # one warm-up; the capturing call's result, too, comes from the graph
    assert compiled.captures == 1
    assert prof.per_rank == st.per_rank and prof.count == st.count
    eager = [e for e in prof.events if e.op != "gt.compile graph"]
    graph = [e for e in prof.events if e.op == "gt.compile graph"]
    assert eager and {e.op for e in eager} == {"gradient bucket"}       # the warm-up's backward, bucketed
    assert {e.phase for e in graph} == {"compiled"}
    assert {e.op for e in prof.captured} == {"gradient bucket"} and prof.captured[0].phase == "backward"
    per_call = Counter((e.collective, e.group, tuple(sorted(e.bytes_per_rank.items()))) for e in prof.captured)
    run = Counter((e.collective, e.group, tuple(sorted(e.bytes_per_rank.items()))) for e in graph)
    assert run == Counter({k: graph_calls * n for k, n in per_call.items()})


def test_bad_arguments(world4):
    with pytest.raises(TypeError, match="comm_profile\\(module\\): expected a torch.nn.Module"):
        gt.comm_profile("model")
    with gt.comm_profile() as prof:
        pass
    with pytest.raises(ValueError, match="by: expected one or more of"):
        prof.rows(("op", "rank"))
    assert prof.rows() == [] and "no collectives" in prof.table()
