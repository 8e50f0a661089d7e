"""Pointwise rules (ops/rules/pointwise.py): broadcasting, casts, in-place and out= ops, and
partial sums passing only through ops that are linear in them."""

import pytest
import torch

import globaltensor as gt
from globaltensor.sbp import broadcast as B, partial_sum as P, split as S
from harness import candidate_signatures, check_all, check_candidates, check_layouts, lay, sigs

aten = torch.ops.aten
torch.manual_seed(0)

X = torch.randn(7, 5)
Y = torch.randn(7, 5)





def has_partial(op, *args, **kwargs):
    return any(s.outputs[0].is_partial for s in candidate_signatures(op, *args, **kwargs))


# -- candidates against one device -----------------------------------------------------------

@pytest.mark.parametrize("op", [aten.exp.default, aten.sigmoid.default, aten.abs.default, aten.neg.default,
                                aten.sqrt.default, aten.log1p.default])
def test_unary(op):
    x = X.abs() if op in (aten.sqrt.default, aten.log1p.default) else X
    assert check_candidates(op, x, max_2d=6) >= 2


@pytest.mark.parametrize("shapes", [((7, 5), (7, 5)), ((5, 1), (1, 4)), ((3, 1, 4), (4,)), ((6,), ())],
                         ids=["same", "outer", "3d-1d", "scalar"])
def test_binary_broadcasting(shapes):
    a, b = torch.randn(shapes[0]), torch.randn(shapes[1]).abs() + 0.5
    kw = {"placements": ("1d",)} if len(shapes[0]) == 3 else {"max_2d": 6}
    for op, extra in [(aten.sub.Tensor, {"alpha": 2}), (aten.div.Tensor, {}), (aten.maximum.default, {}),
                      (aten.pow.Tensor_Tensor, {})]:
        x = a.abs() if op is aten.pow.Tensor_Tensor else a
        assert check_candidates(op, x, b, **kw, **extra) > 0


def test_size_one_dims_stay_broadcast():
    a, b = torch.randn(5, 1), torch.randn(1, 4)
    assert sigs(aten.add.Tensor, a, b) >= {"S(0), B -> S(0)", "B, S(1) -> S(1)", "P, P -> P"}
    with gt.simulate(4):
        with gt.comm_stats() as stats:
            y = lay(a, S(0)) * lay(b, S(1))      # outer product of splits: one must move
        torch.testing.assert_close(y.full_tensor(), a * b)
        with gt.comm_stats() as stats:
            y = lay(a, S(0)) * lay(b, B)
        assert y.sbp == (S(0),) and stats.bytes_sent == 0


def test_ternary():
    c = X > 0
    kw = {"max_2d": 6}
    assert check_candidates(aten.where.self, c, X, Y, **kw) >= 3
    assert check_candidates(aten.where.self, c[:, :1], X, Y[0], **kw) >= 3
    assert check_candidates(aten.addcmul.default, X, Y, X[0], value=0.5, **kw) >= 3
    assert check_candidates(aten.addcdiv.default, X, Y, X.abs() + 1, value=2, **kw) >= 3
    assert check_candidates(aten.lerp.Scalar, X, Y, 0.3, **kw) >= 3
    assert check_candidates(aten.lerp.Tensor, X, Y, torch.rand(5), **kw) >= 3
    assert check_candidates(aten.clamp.Tensor, X, Y[0] - 1, Y[0] + 1, **kw) >= 2


@pytest.mark.parametrize("op", [aten.eq.Tensor, aten.gt.Tensor, aten.le.Tensor, aten.ne.Tensor,
                                aten.logical_and.default])
def test_comparisons(op):
    assert check_candidates(op, X, (Y > 0).to(X.dtype) if op is aten.logical_and.default else X.round(),
                            max_2d=6) >= 2
    assert not has_partial(op, X, Y)


def test_masked_fill():
    mask = X > 0.3
    assert check_candidates(aten.masked_fill.Scalar, X, mask, 0.0, max_2d=6) >= 3
    assert check_candidates(aten.masked_fill.Scalar, X, mask, -2.0, max_2d=6) >= 2
    assert check_candidates(aten.masked_fill.Tensor, X, mask[0], torch.tensor(4.0), max_2d=6) >= 2
    assert has_partial(aten.masked_fill.Scalar, X, mask, 0.0)         # zeros sum to zero
    assert not has_partial(aten.masked_fill.Scalar, X, mask, -2.0)    # -2 would be taken k times
    assert not has_partial(aten.masked_fill.Tensor, X, mask, torch.tensor(0.0))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.int32, torch.bool])
def test_casts(dtype):
    tol = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.float16 else {}     # each piece rounds on its own
    assert check_candidates(aten._to_copy.default, X * 4, dtype=dtype, max_2d=6, **tol) >= 2
    assert has_partial(aten._to_copy.default, X, dtype=dtype) == (dtype == torch.float64)   # widening only


def test_clone_detach_alias_copy():
    for op in (aten.clone.default, aten.detach.default, aten.alias.default):
        assert len(candidate_signatures(op, X)) == 3        # S(0), S(1), P
        check_all(op, X, max_2d=6)
    assert check_candidates(aten.copy.default, X, Y[0], max_2d=6) >= 2
    assert check_candidates(aten.copy.default, X, Y, max_2d=6) >= 3
    assert not has_partial(aten.copy_.default, X.int(), Y)               # rounding into an int is not linear


def test_composite_random_layouts_with_grad():
    def fn(x, y, z):
        return torch.where(x > 0, x * y, (x - y).exp()) + torch.sigmoid(z) * y - x.abs() / (1 + z * z)
    check_layouts(fn, X, Y, torch.randn(5), trials=5, grad=True)


# -- partial sums ------------------------------------------------------------------------------

def test_linear_candidates():
    assert "P, P -> P" in sigs(aten.add.Tensor, X, Y, alpha=3)
    assert "P, P -> P" in sigs(aten.sub.Tensor, X, Y)
    assert {"P, B -> P", "B, P -> P"} <= sigs(aten.mul.Tensor, X, Y)
    assert "P, B -> P" in sigs(aten.div.Tensor, X, Y)
    assert "B, P -> P" not in sigs(aten.div.Tensor, X, Y)                         # 1 / (a + b)
    assert not has_partial(aten.div.Tensor_mode, X, Y, rounding_mode="floor")    # floor is not linear
    assert "B, P, P -> P" in sigs(aten.where.self, X > 0, X, Y)                   # the condition broadcast
    assert not any(s.startswith("P") for s in sigs(aten.where.self, X > 0, X, Y))
    for op in (aten.exp.default, aten.relu.default, aten.sigmoid.default, aten.abs.default):
        assert not has_partial(op, X), op
    assert not has_partial(aten.add.Tensor, X, 1.0)                             # P + 1 adds 1 per rank
    assert not has_partial(aten.pow.Tensor_Scalar, X, 2)
    assert not has_partial(aten.add.Tensor, X.int(), Y.int())                   # integers are not summed here


@pytest.mark.parametrize("name,fn", [
    ("add", lambda a, b: a + b), ("sub alpha", lambda a, b: torch.sub(a, b, alpha=0.5)),
    ("neg", lambda a, b: -a), ("to float64", lambda a, b: a.to(torch.float64)),
    ("where", lambda a, b: torch.where((X > 0), a, b)),
])
def test_linear_ops_keep_partial_without_communication(name, fn):
    with gt.simulate(4):
        a, b = lay(X, P, seed=1), lay(Y, P, seed=2)
        with gt.comm_stats() as stats:
            y = fn(a, b)
        assert y.sbp == (P,), name
        assert stats.bytes_sent == 0, name
        torch.testing.assert_close(y.full_tensor(), fn(X, Y).to(y.dtype))


@pytest.mark.parametrize("name,fn", [
    ("mul by B", lambda a, b: a * b), ("div by B", lambda a, b: a / b),
    ("masked_fill 0", lambda a, b: a.masked_fill((X > 0), 0.0)),
])
def test_a_partial_meeting_a_broadcast_tensor_is_reduced_once_first(name, fn):
    """Linear in the partial input, but keeping P would only move the reduction on (an output
    of the same size): the partial input is all-reduced once, and -- with grad mode off, as in
    the backward pass -- a second such op reads the kept reduced copy (ops/decide/cost.py,
    ops/kept_boxed_copy.py)."""
    with gt.simulate(4):
        a, b = lay(X, P, seed=1), lay(Y, B)
        with torch.no_grad(), gt.comm_stats() as stats:
            y = fn(a, b)
            z = fn(a, b + 1)
        assert y.sbp == (B,) and z.sbp == (B,), name
        assert stats.ops() == ["all_reduce"], name
        torch.testing.assert_close(y.full_tensor(), fn(X, Y))


@pytest.mark.parametrize("name,fn", [
    ("relu", torch.relu), ("exp", torch.exp), ("sigmoid", torch.sigmoid), ("square", lambda v: v * v.exp()),
    ("pow", lambda v: v ** 2), ("abs", torch.abs), ("plus scalar", lambda v: v + 1.0),
    ("minus scalar", lambda v: 2.0 - v), ("floor div", lambda v: torch.div(v, 0.3, rounding_mode="floor")),
    ("to int", lambda v: (v * 10).to(torch.int64)), ("to bool", lambda v: v.to(torch.bool)),
    ("masked_fill 2", lambda v: v.masked_fill((X > 0), 2.0)), ("gt", lambda v: v > 0),
    ("clamp", lambda v: v.clamp(-0.5, 0.5)), ("reciprocal", lambda v: 1 / v),
])
def test_nonlinear_ops_reduce_partial_inputs_first(name, fn):
    """With random partial pieces (each far from the value) a partial passed through gives garbage.
    (``v * v`` may legitimately stay partial as ``P * B``; ``v * v.exp()`` may not.)"""
    with gt.simulate(4):
        for placement, sbp in (("1d", P), ("2x2", (P, S(0))), ("2x2", (S(1), P))):
            x = lay(X, sbp, placement, seed=3)
            y = fn(x)
            assert not any(v.is_partial for v in y.sbp), (name, y.sbp)
            want = fn(X)
            got = y.full_tensor()
            if want.is_floating_point():
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            else:
                assert torch.equal(got, want), name


# -- in-place and out= -------------------------------------------------------------------------

IN_PLACE = [
    ("add_", lambda x, o: x.add_(o, alpha=0.5)), ("sub_", lambda x, o: x.sub_(o)),
    ("mul_", lambda x, o: x.mul_(o)), ("div_", lambda x, o: x.div_(o.abs() + 1)),
    ("clamp_", lambda x, o: x.clamp_(-0.3, 0.4)), ("exp_", lambda x, o: x.exp_()),
    ("masked_fill_", lambda x, o: x.masked_fill_(o > 0, 1.5)), ("copy_", lambda x, o: x.copy_(o)),
    ("zero_", lambda x, o: x.zero_()), ("fill_", lambda x, o: x.fill_(2.0)),
    ("mul_ scalar", lambda x, o: x.mul_(3.0)), ("add_ scalar", lambda x, o: x.add_(1.0)),
]


@pytest.mark.parametrize("name,fn", IN_PLACE, ids=[n for n, _ in IN_PLACE])
def test_in_place_keeps_layout(name, fn):
    want = fn(X.clone(), Y)
    with gt.simulate(4):
        for xs, os_ in ((S(0), S(0)), (S(1), P), (P, S(0)), (P, P), (B, S(1)), (S(0), B)):
            x = lay(X, xs, seed=4).clone()
            other = lay(Y, os_, seed=5)
            out = fn(x, other)
            assert out is x, name
            assert x.sbp == (xs,), (name, xs, os_)
            torch.testing.assert_close(x.full_tensor(), want, msg=lambda m: f"{name} {xs} {os_}: {m}")
        x = lay(X, (S(0), P), "2x2", seed=6).clone()
        fn(x, lay(Y, (B, S(1)), "2x2"))
        assert x.sbp == (S(0), P)
        torch.testing.assert_close(x.full_tensor(), want)


def test_in_place_on_split_keeps_pieces_without_communication():
    with gt.simulate(4):
        x = lay(X, S(0)).clone()
        pieces = {r: t.data_ptr() for r, t in x.local_tensors().items()}
        with gt.comm_stats() as stats:
            x.mul_(lay(Y, S(0))).add_(2.0).sigmoid_()
        assert stats.bytes_sent == 0
        assert {r: t.data_ptr() for r, t in x.local_tensors().items()} == pieces
        torch.testing.assert_close(x.full_tensor(), (X * Y + 2).sigmoid())


@pytest.mark.parametrize("out_sbp", [S(0), S(1), B, P])
def test_out_variants(out_sbp):
    with gt.simulate(4):
        a, b = lay(X, S(0)), lay(Y, P, seed=7)
        c = lay(torch.zeros(7, 5), out_sbp).clone()
        r = torch.add(a, b, alpha=2, out=c)
        assert r is c and c.sbp == (out_sbp,)
        torch.testing.assert_close(c.full_tensor(), X + 2 * Y)
        r = torch.mul(a, 3.0, out=c)
        assert r is c and c.sbp == (out_sbp,)
        torch.testing.assert_close(c.full_tensor(), X * 3)
        torch.exp(b, out=c)
        torch.testing.assert_close(c.full_tensor(), Y.exp())
        torch.where(a > 0, a, b, out=c)
        torch.testing.assert_close(c.full_tensor(), torch.where(X > 0, X, Y))
        with pytest.raises(TypeError, match="plain"):
            torch.add(a, b, out=torch.zeros(7, 5))


def test_plain_tensors_and_scalars_mix_in():
    with gt.simulate(4):
        x = lay(X, S(1))
        y = x * torch.arange(5.0) + 2 - torch.tensor(0.5) * x
        assert y.sbp == (S(1),)
        torch.testing.assert_close(y.full_tensor(), X * torch.arange(5.0) + 2 - 0.5 * X)
