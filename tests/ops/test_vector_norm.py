"""p-norms of split and partial tensors (ops/rules/vector_norm.py): each rank's piece norm, combined
over the ranks that split the reduced dims -- scalars move, never the tensor -- equal to one device;
``_foreach_norm`` in one collective per group; clipping (``clip_grad_norm_``, ``get_total_norm``,
``clip_grad_value_``) in DP, TP and ZeRO adds scalars only.

Tolerances: float64 throughout; a norm here is the same sum of ``|x| ** p`` as on one device taken in
another order (pieces first), so it differs by a few ulps of the sum: ``rtol=1e-12`` holds any
order of at most a few hundred terms (each addition rounds by at most 2**-53 relative)."""
from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import globaltensor as gt
from harness import PLACEMENTS, check_layouts, make_global, no_fallback

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
ORDERS = [2, 1, math.inf, -math.inf, 0, 3, 0.5, -1]
CLOSE = dict(rtol=1e-12, atol=1e-300, equal_nan=True)


def _scalar_traffic(st_, out_numel: int, world: int = 4) -> None:
    """Every collective moved the result's elements, not the input's: no more bytes than an all-gather
    of one result per rank (an inf-norm's) or an all-reduce of the result. (Where the input is as
    small as that, the cost model may move it instead -- an all-to-all of a few elements -- within
    the same bound.)"""
    most = max(2 * out_numel * 8, world * out_numel * 8)
    for r in st_.records:
        assert r.bytes <= most, (r.op, r.bytes, most)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=st.lists(st.integers(0, 7), min_size=1, max_size=3), placement=st.sampled_from(sorted(PLACEMENTS)),
       p=st.sampled_from(ORDERS), keepdim=st.booleans(), data=st.data())
def test_a_norm_in_any_layout_equals_one_device_and_moves_scalars(shape, placement, p, keepdim, data):
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(len(shape)))
    x[..., :1] = 0.0                      # zeros: p = 0 counts them, a negative p meets 1 / 0
    dims = data.draw(st.one_of(st.none(), st.lists(st.integers(0, len(shape) - 1), min_size=1, unique=True)))
    if (p < 0 or math.isinf(p)) and any(shape[d] == 0 for d in (range(len(shape)) if dims is None else dims)):
        return                  # no identity: torch refuses such a norm of nothing, on one device too
    want = torch.linalg.vector_norm(x, p, dims, keepdim)
    with gt.simulate(4):
        pl = PLACEMENTS[placement]()
        choices = [B, P] + [S(d) for d in range(len(shape))]
        nd = tuple(data.draw(st.sampled_from(choices)) for _ in range(pl.ndim))
        # a partial input as B -> P boxes it (one rank holds the value, the others zeros): exact, so
        # that p = 0 and p < 1, which magnify a rounding near 0, compare exactly too
        g = gt.distribute(x, pl, tuple(B if v.is_partial else v for v in nd)).to_global(sbp=nd)
        with no_fallback(), gt.comm_stats() as st_:
            got = torch.linalg.vector_norm(g, p, dims, keepdim)
        torch.testing.assert_close(got.full_tensor(), want, **CLOSE)
        if not any(v.is_partial for v in nd):
            _scalar_traffic(st_, want.numel())


@pytest.mark.parametrize("p", [2, 1, math.inf, 3])
def test_the_gradient_of_a_norm_keeps_the_split(p):
    """The backward is pointwise in the split input and the whole norm: each input's gradient in its
    layout, equal to one device."""
    x = torch.randn(9, 5, dtype=torch.float64)
    check_layouts(lambda t: torch.linalg.vector_norm(t, p), x, grad=True, rtol=1e-12, atol=1e-14)
    check_layouts(lambda t: torch.linalg.vector_norm(t, p, dim=0), x, grad=True, rtol=1e-12, atol=1e-14)


def test_torch_norm_and_tensor_norm_take_the_same_path(p1):
    x = torch.randn(12, 6, dtype=torch.float64)
    g = gt.distribute(x, p1, S(0))
    with gt.comm_stats() as st_:
        got = [g.norm(), torch.norm(g, p=1, dim=0), torch.norm(g, p=3), g.norm(dim=(0, 1), keepdim=True)]
    want = [x.norm(), torch.norm(x, p=1, dim=0), torch.norm(x, p=3), x.norm(dim=(0, 1), keepdim=True)]
    for a, b in zip(got, want):
        torch.testing.assert_close(a.full_tensor(), b, **CLOSE)
    _scalar_traffic(st_, 6)


def test_a_2x2_norm_reduces_over_both_axes_and_keeps_a_kept_split(p2):
    """``(S(0), S(1))`` reduced whole: the pieces' norms combine over all 4 ranks. Reduced over dim 0
    only: axis 0 combines, axis 1 keeps its split of the result."""
    x = torch.randn(9, 7, dtype=torch.float64)
    g = gt.distribute(x, p2, (S(0), S(1)))
    whole = torch.linalg.vector_norm(g)
    rows = torch.linalg.vector_norm(g, dim=0)
    assert whole.sbp == (B, B) and rows.sbp == (B, S(0))
    torch.testing.assert_close(whole.full_tensor(), torch.linalg.vector_norm(x), **CLOSE)
    torch.testing.assert_close(rows.full_tensor(), torch.linalg.vector_norm(x, dim=0), **CLOSE)


def test_norms_without_an_identity_on_empty_pieces(p1):
    """3 rows over 4 ranks: one piece is empty; where torch refuses its norm (inf, negative p) it
    takes a value that changes nothing, not torch's error."""
    x = torch.randn(3, 4, dtype=torch.float64)
    g = gt.distribute(x, p1, S(0))
    for p in (math.inf, -math.inf, -1, -0.5):
        torch.testing.assert_close(torch.linalg.vector_norm(g, p).full_tensor(), torch.linalg.vector_norm(x, p),
                                   **CLOSE)


def test_a_partial_input_is_reduce_scattered_when_that_is_cheaper(p1):
    """A partial 64x64 input: reduce-scatter (3/4 of it per rank) and a scalar, not an all-reduce of it."""
    x = torch.randn(64, 64, dtype=torch.float64)
    g = make_global(x, p1, (P,), random.Random(1))
    with gt.comm_stats() as st_:
        got = torch.linalg.vector_norm(g)
    torch.testing.assert_close(got.full_tensor(), torch.linalg.vector_norm(x), **CLOSE)
    assert st_.ops() == ["reduce_scatter", "all_reduce"], st_.ops()


def test_foreach_norm_combines_every_split_element_in_one_collective(p1):
    xs = [torch.randn(s, dtype=torch.float64) for s in [(10, 6), (7,), (4, 3, 5), (6, 10), ()]]
    gs = [gt.distribute(x, p1, sbp) for x, sbp in zip(xs, [S(0), S(0), S(1), B, B])]
    for p in (2, math.inf):
        with gt.comm_stats() as st_:
            got = torch._foreach_norm(gs, p)
        for a, b in zip(got, torch._foreach_norm(xs, p)):
            assert a.sbp == (B,)
            torch.testing.assert_close(a.full_tensor(), b, **CLOSE)
        assert st_.count == 1, st_.ops()
        _scalar_traffic(st_, 3)


def _model(placement, plan):
    """The test's model, laid out by ``plan`` on ``placement`` (None: on one device)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8)).double()
    if placement is not None:
        gt.nn.distribute_module(m, placement, plan)
    return m


def _grad_step(m, placement, batch_sbp, zero: bool, clip):
    """One backward and step (ZeRO or AdamW) with ``clip(params)`` between: the step's traffic and
    what ``clip`` returned."""
    opt = gt.nn.ZeroOptimizer(m.parameters(), torch.optim.AdamW, axis=0, lr=0.1) if zero else \
        torch.optim.AdamW(m.parameters(), lr=0.1)
    x = torch.randn(8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    if placement is not None:
        x = gt.distribute(x, placement, batch_sbp)
    with gt.comm_stats() as st_:
        m(x).pow(2).mean().backward()
        result = clip(list(m.parameters()))
        opt.step()
    return st_, result


CLIPS = {
    "clip_grad_norm_": lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.05),
    "clip_grad_norm_ foreach=False": lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.05, foreach=False),
    "clip_grad_norm_ inf": lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.05, norm_type=math.inf),
    "clip_grad_norm_ error_if_nonfinite": lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.05, error_if_nonfinite=True),
    "get_total_norm": lambda ps: torch.nn.utils.get_total_norm([p.grad for p in ps]),
    "clip_grad_value_": lambda ps: torch.nn.utils.clip_grad_value_(ps, 0.01),
}
SETUPS = {
    "DP": ({}, S(0), False),
    "TP": (gt.nn.megatron_plan(column=["0"], row=["2"]), B, False),
    "ZeRO": ({}, S(0), True),
}


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("clip", list(CLIPS))
def test_clipping_adds_scalars_only_and_equals_one_device(p1, setup, clip):
    """Clipping costs at most 1 KB a step over the same step without it (ZeRO: never a gathered
    gradient), and the clipped step equals one device's: the norm returned and the parameters."""
    plan, batch_sbp, zero = SETUPS[setup]
    plain, _ = _grad_step(_model(p1, plan), p1, batch_sbp, zero, lambda ps: None)
    m = _model(p1, plan)
    clipped, total = _grad_step(m, p1, batch_sbp, zero, CLIPS[clip])
    assert clipped.bytes_sent - plain.bytes_sent <= 1024, (clipped, plain)
    ref = _model(None, None)
    _, ref_total = _grad_step(ref, None, None, False, CLIPS[clip])
    if ref_total is not None:
        torch.testing.assert_close(total.full_tensor(), ref_total, **CLOSE)
    for a, b in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(a.full_tensor(), b.detach(), **CLOSE)
