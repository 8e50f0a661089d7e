"""Scans and sorts along one dim (ops/rules/scan.py): every candidate against one device on even,
uneven and short shapes, the candidate sets, gradients on random layouts, in-place scans, and no
fallback."""
import random

import pytest
import torch

import globaltensor as gt
from globaltensor.sbp import broadcast as B, partial_sum as P, split as S
from harness import PLACEMENTS, check_all, check_layouts, make_global, no_fallback, sigs

aten = torch.ops.aten

SHAPES = [(8, 6), (7, 5, 3), (3, 5)]   # even, uneven, a dim shorter than the 4 ranks (empty pieces)


def _data(shape, seed=0):
    """Distinct values (no ties, so sorts are the same on any piece) in a range exp and prod keep tame."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    return (torch.randperm(n, generator=g).reshape(shape).float() / n + 0.5) * torch.sign(
        torch.randn(shape, generator=g))


# (op, args after the input, kwargs)
CASES = [
    (aten.cumsum.default, (0,), {}),
    (aten.cumsum.default, (-1,), {}),
    (aten.cumsum.default, (1,), {"dtype": torch.float64}),
    (aten.cumprod.default, (1,), {}),
    (aten.cumprod.default, (0,), {}),
    (aten.logcumsumexp.default, (-1,), {}),
    (aten.cummax.default, (1,), {}),
    (aten.cummin.default, (0,), {}),
    (aten.sort.default, (), {}),
    (aten.sort.default, (0, True), {}),
    (aten.sort.stable, (), {"stable": True, "dim": 1, "descending": False}),
    (aten.topk.default, (2,), {}),
    (aten.topk.default, (2, 0, False, True), {}),
    (aten.topk.default, (3, 1, True, False), {}),
]


def _id(case):
    op, args, kwargs = case
    return f"{op}{list(args)}" + "".join(f"-{k}={v}" for k, v in kwargs.items())


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_candidates(case, shape):
    op, args, kwargs = case
    assert check_all(op, _data(shape), *args, **kwargs) > 0


def test_candidate_sets():
    x = torch.empty(7, 5, 3)
    assert sigs(aten.cumsum.default, x, 1) == {"S(0) -> S(0)", "S(2) -> S(2)", "P -> P"}
    assert sigs(aten.cumsum.default, x, -1, dtype=torch.float64) == {"S(0) -> S(0)", "S(1) -> S(1)", "P -> P"}
    # a cast to an integer type rounds each piece; bool has no partial at all
    assert sigs(aten.cumsum.default, x, 0, dtype=torch.int64) == {"S(1) -> S(1)", "S(2) -> S(2)"}
    assert "P -> P" not in sigs(aten.cumsum.default, x.bool(), 0)
    assert "P -> P" in sigs(aten.cumsum.default, x.long(), 0)
    # not linear: no partial input
    assert sigs(aten.cumprod.default, x, 0) == {"S(1) -> S(1)", "S(2) -> S(2)"}
    assert sigs(aten.sort.default, x) == {"S(0) -> S(0), S(0)", "S(1) -> S(1), S(1)"}
    assert sigs(aten.topk.default, x, 2, 1) == {"S(0) -> S(0), S(0)", "S(2) -> S(2), S(2)"}
    assert sigs(aten.cummax.default, torch.empty(5), 0) == set()
    assert sigs(aten.cumsum.default, torch.empty(()), 0) == {"P -> P"}


def test_int_and_bool_cumsum():
    ints = torch.randint(-5, 6, (7, 5))
    assert check_all(aten.cumsum.default, ints, 1) >= 2
    assert check_all(aten.cumsum.default, ints > 0, 0) >= 1


def test_zero_dim_input():
    x = torch.tensor(1.5)
    check_layouts(lambda t: (t.cumsum(0), t.cumprod(0), t.sort()[0], t.topk(1)[0]), x, trials=2)


@pytest.mark.parametrize("fn", [
    lambda t: t.cumsum(1), lambda t: t.cumsum(0) * t, lambda t: t.cumprod(1), lambda t: torch.logcumsumexp(t, 0),
    lambda t: torch.cummax(t, 1).values, lambda t: torch.cummin(t, 0).values, lambda t: t.sort(1).values,
    lambda t: t.sort(0, descending=True).values, lambda t: t.topk(2, 1).values, lambda t: t.topk(3, 0).values,
    lambda t: t.argsort(1).float() * t,
], ids=["cumsum1", "cumsum0", "cumprod", "logcumsumexp", "cummax", "cummin", "sort1", "sort0_desc", "topk1", "topk0",
        "argsort"])
def test_random_layouts_with_grad(fn):
    check_layouts(fn, _data((7, 5)), grad=True, trials=4)


@pytest.mark.parametrize("fn", [lambda t: t.cumsum(1), lambda t: t.cumsum(0)], ids=["cumsum1", "cumsum0"])
def test_cumsum_on_partial_layouts(fn):
    check_layouts(fn, _data((7, 5)), trials=5, partial=True, seed=3)


def test_other_dims_stay_split_without_traffic_or_fallback():
    x0 = _data((7, 5, 3))
    with gt.simulate(4):
        p = PLACEMENTS["2x2"]()
        x = make_global(x0, p, (S(0), S(2)), random.Random(0), requires_grad=True)
        with no_fallback(), gt.comm_stats() as st:
            outs = [x.cumsum(1), x.cumprod(1), torch.logcumsumexp(x, 1), torch.cummax(x, 1).values,
                    torch.cummin(x, 1).indices, x.sort(1).values, x.sort(dim=1, stable=True).indices,
                    x.topk(2, 1).values, x.argsort(1, descending=True)]
        assert st.bytes_sent == 0
        wants = [x0.cumsum(1), x0.cumprod(1), torch.logcumsumexp(x0, 1), torch.cummax(x0, 1).values,
                 torch.cummin(x0, 1).indices, x0.sort(1).values, x0.sort(dim=1, stable=True).indices,
                 x0.topk(2, 1).values, x0.argsort(1, descending=True)]
        for got, want in zip(outs, wants):
            assert got.sbp == (S(0), S(2))
            torch.testing.assert_close(got.full_tensor(), want)
        with no_fallback():
            sum(o.float().sum() for o in outs if o.is_floating_point()).backward()
        assert x.grad.sbp == (S(0), S(2))


def test_scanned_split_dim_is_gathered_and_right():
    x0 = _data((7, 5))
    with gt.simulate(4):
        x = make_global(x0, PLACEMENTS["1d"](), (S(1),), random.Random(0))
        with no_fallback():
            y, (v, i) = x.cumsum(1), x.topk(2, 1)
        torch.testing.assert_close(y.full_tensor(), x0.cumsum(1))
        torch.testing.assert_close(v.full_tensor(), x0.topk(2, 1).values)
        assert torch.equal(i.full_tensor(), x0.topk(2, 1).indices)


@pytest.mark.parametrize("sbp", [S(0), S(1), P, B], ids=str)
def test_in_place_scans_keep_layout(sbp):
    x0 = _data((7, 5))
    with gt.simulate(4):
        x = make_global(x0.clone(), PLACEMENTS["1d"](), (sbp,), random.Random(0))
        y = make_global(x0.clone(), PLACEMENTS["1d"](), (sbp,), random.Random(0))
        with no_fallback():
            out = x.cumsum_(0)
            y.cumprod_(1)
        assert out is x and x.sbp == y.sbp == (sbp,)
        torch.testing.assert_close(x.full_tensor(), x0.cumsum(0))
        torch.testing.assert_close(y.full_tensor(), x0.cumprod(1))
