"""What torch.compile meets at the edges of the global-tensor world: the library's calls trace (as
nonstrict calls AOTAutograd traces through) or break the graph once with a reason naming them, and
never give a wrong value; what cannot be traced (an output shape depending on the data) breaks the
graph once, naming the op, and the library's own frames are never compiled."""
from __future__ import annotations

import warnings

import pytest
import torch

import globaltensor as gt
from dynamo_helpers import graphs_and_breaks

S, B = gt.sbp.split, gt.sbp.broadcast


def _value(v):
    return v.full_tensor() if getattr(v, "is_global", False) else v


# name -> (function of the S(0) input a, the most graph breaks, a word every break reason holds)
CALLS = {
    "gt.to_global": (lambda a: gt.to_global(a * 2, sbp=B) * 3, 0, None),
    "x.to_global": (lambda a: (a * 2).to_global(sbp=B) * 3, 0, None),
    "x.to_global placement": (lambda a: (a * 2).to_global(placement=a.placement, sbp=[B]) * 3, 0, None),
    "full_tensor": (lambda a: (a * 2).full_tensor() + 1, 0, None),
    "to_local": (lambda a: (a * 2).to_local() + 1, 0, None),
    "local_tensors": (lambda a: (a * 2).local_tensors()[1] + 1, 1, "local_tensors"),
    "placement and sbp": (lambda a: a * len(a.placement.rank_list()) if a.sbp[0].is_split else a, 0, None),
    "item": (lambda a: a * float(a.sum()), 1, "item"),
    "gather fallback": (lambda a: torch.histc(a * 2, bins=5) + 1, 0, None),
    "data-dependent shape": (lambda a: a[a > 0] * 2, 1, "nonzero"),
    "nonzero": (lambda a: torch.nonzero(a > 0).float().sum() + 1, 1, "nonzero"),
}


@pytest.mark.filterwarnings("ignore:globaltensor")
@pytest.mark.parametrize("name", list(CALLS))
def test_library_calls_trace_or_break_once_and_give_the_eager_value(p1, name):
    fn, most, word = CALLS[name]
    a = gt.distribute(torch.randn(32, 4), p1, S(0))
    graphs, breaks, reasons = graphs_and_breaks(fn, a)
    assert breaks <= most, reasons
    assert all(word in reason for reason in reasons), reasons
    got, want = torch.compile(fn, backend="aot_eager")(a), fn(a)
    assert torch.equal(_value(got), _value(want))


def test_an_op_through_the_fallback_warns_once_naming_it(p1):
    a = gt.distribute(torch.randn(32, 4), p1, S(0))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.compile(lambda x: torch.histc(x * 3, bins=7), backend="aot_eager")(a)
    ours = [str(w.message) for w in seen if str(w.message).startswith("globaltensor")]
    assert len(ours) <= 1 and all("aten.histc" in m for m in ours), ours


def test_the_librarys_frames_are_never_compiled(p1):
    """After a graph break the dispatcher runs eagerly; Dynamo must not compile its frames."""
    import torch._dynamo
    from torch._dynamo import trace_rules
    a = gt.distribute(torch.randn(32, 4), p1, S(0))
    torch.compile(lambda x: torch.nonzero(x > 0).float().sum(), backend="aot_eager")(a)
    assert trace_rules.check_file(gt.ops.dispatch.__file__).skipped


def test_comm_stats_count_the_trace_not_the_runs(p1):
    """Collectives are issued while the graph is traced; a compiled graph's runs go through torch,
    not the library: gt.comm_stats counts the trace (the first call), as docs/traced.md says."""
    a = gt.distribute(torch.randn(32, 4), p1, S(0))
    compiled = torch.compile(lambda x: gt.to_global(x * 2, sbp=B).sum(), backend="aot_eager")
    with gt.comm_stats() as first:
        compiled(a)
    with gt.comm_stats() as later:
        compiled(a)
        compiled(a)
    assert first.bytes_sent > 0 and later.bytes_sent == 0, (first.bytes_sent, later.bytes_sent)


def test_the_flatten_protocol_round_trips(p2):
    from torch.utils._python_dispatch import transform_subclass
    x = gt.distribute(torch.randn(6, 5), p2, (S(0), B))
    names, context = x.__tensor_flatten__()
    assert names == [f"_piece_{r}" for r in range(4)] and context[0] == x.layout_meta
    y = transform_subclass(x, lambda name, piece: piece.clone())
    assert y.layout_meta == x.layout_meta and torch.equal(y.full_tensor(), x.full_tensor())


def test_a_tangent_in_another_layout_is_boxed_to_the_expected_one(p1):
    partial = gt.distribute(torch.ones(()), p1, B).to_global(sbp=gt.sbp.partial_sum)
    grad = gt.distribute(torch.ones(()), p1, B)
    coerced = grad.__coerce_same_metadata_as_tangent__(partial.__tensor_flatten__()[1])
    assert coerced.sbp == partial.sbp and torch.equal(coerced.full_tensor(), grad.full_tensor())
