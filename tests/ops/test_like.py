"""*_like and new_* rules: every candidate against one device (structure only where the values
are undefined), the layouts they keep, and sharding-invariant rand_like / randn_like."""
import random

import pytest
import torch

import globaltensor as gt
from globaltensor.sbp import nd_candidates
from harness import PLACEMENTS, candidate_signatures, check_candidates, check_layouts, make_global

aten = torch.ops.aten
S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum

SHAPES = [(8, 6), (7, 5), (3, 5), ()]
_ids = {"ids": lambda s: "x".join(map(str, s)) or "scalar"}


@pytest.mark.parametrize("shape", SHAPES, **_ids)
@pytest.mark.parametrize("op,args,kwargs", [
    (aten.zeros_like.default, (), {}),
    (aten.ones_like.default, (), {}),
    (aten.ones_like.default, (), {"dtype": torch.int32}),
    (aten.full_like.default, (2.5,), {}),
    (aten.full_like.default, (7,), {"dtype": torch.int64}),
], ids=["zeros", "ones", "ones_int32", "full", "full_int"])
def test_like_candidates(op, args, kwargs, shape):
    x = torch.randn(shape)
    assert check_candidates(op, x, *args, **kwargs) > 0


@pytest.mark.parametrize("shape", SHAPES, **_ids)
@pytest.mark.parametrize("size", ["same", (3, 2), (9,), ()])
@pytest.mark.parametrize("op,args", [(aten.new_zeros.default, ()), (aten.new_ones.default, ()),
                                     (aten.new_full.default, (-1.5,))], ids=["zeros", "ones", "full"])
def test_new_candidates(op, args, size, shape):
    x = torch.randn(shape)
    size = list(shape) if size == "same" else list(size)
    assert check_candidates(op, x, size, *args) > 0
    check_candidates(op, x, size, *args, dtype=torch.float64, placements=("2x2",), max_2d=4)


def _check_structure(op, x, *args, **kwargs):
    """For ops with undefined values: every candidate gives the right shape, dtype and layout,
    and every rank holds a piece of its layout's shape."""
    want = op(x, *args, **kwargs)
    sigs = candidate_signatures(op, x, *args, **kwargs)
    rng = random.Random(0)
    ran = 0
    with gt.simulate(4):
        for name in ("1d", "2x2"):
            p = PLACEMENTS[name]()
            combos = nd_candidates([sigs] * p.ndim)
            for c in combos:
                out = op(make_global(x, p, c.inputs[0], rng), *args, **kwargs)
                # the dispatcher picks among the candidates taking this input layout
                allowed = {d.outputs[0] for d in combos if d.inputs == c.inputs}
                assert (tuple(out.shape), out.dtype) == (tuple(want.shape), want.dtype)
                assert out.sbp in allowed, (c, out.sbp)
                for r, piece in out.local_tensors().items():
                    assert tuple(piece.shape) == out.layout_meta.piece_shape(r), (c, r)
                    assert piece.dtype == want.dtype
                ran += 1
    return ran


@pytest.mark.parametrize("shape", SHAPES, **_ids)
def test_empty_like_and_new_empty_structure(shape):
    x = torch.randn(shape)
    assert _check_structure(aten.empty_like.default, x) > 0
    assert _check_structure(aten.empty_like.default, x, dtype=torch.float16) > 0
    assert _check_structure(aten.new_empty.default, x, list(shape)) > 0
    assert _check_structure(aten.new_empty.default, x, [5, 1, 2]) > 0


def test_candidate_sets():
    x = torch.empty(7, 5)
    sigs = lambda op, *a: {repr(c) for c in candidate_signatures(op, x, *a)}  # noqa: E731
    # zeros sum to zero, so a partial input may stay partial; ones may not
    assert sigs(aten.zeros_like.default) == {"S(0) -> S(0)", "S(1) -> S(1)", "P -> B", "P -> P"}
    assert sigs(aten.ones_like.default) == {"S(0) -> S(0)", "S(1) -> S(1)", "P -> B"}
    assert sigs(aten.new_ones.default, [7, 5]) == {"S(0) -> S(0)", "S(1) -> S(1)", "S(0) -> B", "S(1) -> B",
                                                  "P -> B"}
    assert sigs(aten.new_ones.default, [5, 7]) == {"S(0) -> B", "S(1) -> B", "P -> B"}


def _global(t, sbp, ranks=(0, 1, 2, 3)):
    return gt.distribute(t, gt.placement("cpu", list(ranks)), sbp)


def test_like_of_partial_is_broadcast_without_traffic():
    x = torch.randn(7, 5)
    with gt.simulate(4):
        gx = gt.to_global(x / 4, placement=gt.placement("cpu", [0, 1, 2, 3]), sbp=P)
        with gt.comm_stats() as st:
            outs = [torch.ones_like(gx), torch.zeros_like(gx), torch.full_like(gx, 3.0), gx.new_ones(7, 5)]
        assert st.bytes_sent == 0
        assert all(o.sbp == (B,) for o in outs)
        torch.testing.assert_close(outs[0].full_tensor(), torch.ones(7, 5))
        torch.testing.assert_close(outs[1].full_tensor(), torch.zeros(7, 5))
        torch.testing.assert_close(outs[2].full_tensor(), torch.full((7, 5), 3.0))


def test_new_of_split_keeps_split_for_same_size():
    x = torch.randn(3, 5)    # rank 3's piece is empty
    with gt.simulate(4):
        gx = _global(x, S(0))
        with gt.comm_stats() as st:
            same, other = gx.new_zeros(3, 5), gx.new_full((2, 4), 9.0)
            like = torch.ones_like(gx, dtype=torch.int32)
        assert st.bytes_sent == 0
        assert same.sbp == like.sbp == (S(0),) and other.sbp == (B,)
        assert [tuple(t.shape) for t in same.local_tensors().values()] == [(1, 5), (1, 5), (1, 5), (0, 5)]
        assert torch.equal(other.full_tensor(), torch.full((2, 4), 9.0))
        assert torch.equal(like.full_tensor(), torch.ones(3, 5, dtype=torch.int32))


def test_backward_of_a_sum_seeds_and_spreads_gradient_without_traffic():
    """autograd seeds the gradient of a partial loss with ones_like: a broadcast, no all-reduce."""
    x = torch.randn(7, 5)
    with gt.simulate(4):
        gx = _global(x, S(0)).requires_grad_(True)
        with gt.comm_stats() as st:
            loss = (gx * gx).sum()
            loss.backward()
        assert st.bytes_sent == 0
        assert loss.sbp == (P,) and gx.grad.sbp == (S(0),)
        torch.testing.assert_close(gx.grad.full_tensor(), 2 * x)


def test_like_in_compositions():
    def fn(t):
        return t * torch.ones_like(t) + torch.full_like(t, 0.5) - t.new_zeros(t.shape) + torch.zeros_like(t)
    check_layouts(fn, torch.randn(7, 5), grad=True, trials=4)
    check_layouts(fn, torch.randn(7, 5), trials=4, partial=True)


# -- sharding-invariant random ---------------------------------------------------------------------

LAYOUTS = [("1d", B), ("1d", S(0)), ("1d", S(1)), ("1d", P), ("2x2", (S(0), S(1))), ("2x2", (S(1), S(1))),
           ("2x2", (P, S(0)))]


@pytest.mark.parametrize("shape", [(7, 5), (3, 2)], **_ids)
@pytest.mark.parametrize("fn,factory", [(torch.rand_like, gt.rand), (torch.randn_like, gt.randn)],
                         ids=["rand_like", "randn_like"])
def test_random_like_is_sharding_invariant(fn, factory, shape):
    with gt.simulate(4):
        gt.manual_seed(11)
        want = factory(*shape, placement=PLACEMENTS["1d"](), sbp=B).full_tensor()
        for name, sbp in LAYOUTS:
            gx = make_global(torch.randn(shape), PLACEMENTS[name](), sbp if isinstance(sbp, tuple) else (sbp,),
                             random.Random(0))
            gt.manual_seed(11)
            out = fn(gx)
            assert out.sbp == tuple(B if v.is_partial else v for v in gx.sbp)
            if out.sbp == (B,):
                pieces = list(out.local_tensors().values())
                assert all(torch.equal(pieces[0], q) for q in pieces[1:]), "broadcast replicas differ"
            assert torch.equal(out.full_tensor(), want), (name, sbp)
        second = fn(gx)   # the counter moved on: a fresh draw
        assert not torch.equal(second.full_tensor(), want)
        gt.manual_seed(11)
        assert fn(gx, dtype=torch.float64).dtype == torch.float64


def test_random_like_values():
    with gt.simulate(4):
        gt.manual_seed(3)
        gx = _global(torch.zeros(64, 50), S(1))
        u, n = torch.rand_like(gx).full_tensor(), torch.randn_like(gx).full_tensor()
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.03
    assert abs(n.mean()) < 0.05 and abs(n.std() - 1) < 0.05
    assert not torch.equal(u[:32], u[32:])


def test_randint_like_is_sharding_invariant_and_replicas_agree():
    """Like rand_like: B replicas hold one value, and the logical tensor is the same for every layout."""
    results = []
    for n, sbp in ((1, (B,)), (4, (S(0),)), (4, (B,))):
        gt.manual_seed(11)
        with gt.simulate(n):
            p = gt.placement("cpu", list(range(n)))
            x = torch.ops.aten.randint_like.low_dtype(gt.zeros(9, 7, placement=p, sbp=sbp), 3, 50)
            pieces = list(x.local_tensors().values())
            if sbp == (B,):
                assert all(torch.equal(pieces[0], q) for q in pieces[1:]), "replicas differ"
            results.append(x.full_tensor())
    assert all(torch.equal(results[0], r) for r in results[1:])
    assert results[0].min() >= 3 and results[0].max() < 50 and len(results[0].unique()) > 20
    gt.manual_seed(11)
    with gt.simulate(4):
        y = torch.randint_like(gt.zeros(9, 7, placement=gt.placement("cpu", [0, 1, 2, 3]), sbp=S(1)), 5)
        assert y.sbp == (S(1),) and 0 <= y.full_tensor().min() and y.full_tensor().max() < 5
