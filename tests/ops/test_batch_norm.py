"""Batch norm (ops/rules/batch_norm.py): batch, spatial and channel splits, 1-D and 2x2
placements, train and eval, forward and backward, the ``_native_batch_norm_legit*`` ops --
values and running statistics against one device (float64: exact up to the order of sums),
per-channel sums as the only communication, no fallback; the running statistics in any
layout (partial, split along the channels), each its own, updated as on one device."""
import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st

import globaltensor as gt
from globaltensor.sbp import broadcast as B, partial_sum as P, split as S
from harness import PLACEMENTS, make_global, no_fallback

aten = torch.ops.aten
GEN = torch.Generator().manual_seed(0)
X = torch.randn(8, 6, 5, 4, dtype=torch.float64, generator=GEN) * 3 + 1
W, BIAS = torch.rand(6, dtype=torch.float64, generator=GEN) + 0.5, torch.randn(6, dtype=torch.float64, generator=GEN)
TOL = dict(rtol=1e-12, atol=1e-12)     # float64: the sums differ from one device's by their order only

LAYOUTS = [("1d", (S(0),)), ("1d", (S(2),)), ("1d", (S(1),)), ("1d", (B,)),
           ("2x2", (S(0), S(3))), ("2x2", (S(1), S(0))), ("2x2", (B, S(0)))]


def _lay(t, placement, nd):
    return make_global(t, PLACEMENTS[placement](), nd, random.Random(0))


def _per_channel(nd):
    return tuple(S(0) if v == S(1) else B for v in nd)


@pytest.mark.parametrize("placement,nd", LAYOUTS, ids=[f"{p}-{n}" for p, n in LAYOUTS])
def test_training_step_equals_one_device(world4, placement, nd):
    rm, rv = torch.zeros(6, dtype=torch.float64), torch.ones(6, dtype=torch.float64)
    x_ref, w_ref, b_ref = (t.clone().requires_grad_() for t in (X, W, BIAS))
    g = torch.randn(X.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = F.batch_norm(x_ref, rm, rv, w_ref, b_ref, training=True, momentum=0.3)
    (want * g).sum().backward()
    pc = _per_channel(nd)
    x = _lay(X, placement, nd).requires_grad_()
    w, b = _lay(W, placement, pc).requires_grad_(), _lay(BIAS, placement, pc).requires_grad_()
    grm, grv = _lay(torch.zeros(6, dtype=torch.float64), placement, pc), _lay(torch.ones(6, dtype=torch.float64),
                                                                            placement, pc)
    with no_fallback(), gt.comm_stats() as st:
        y = F.batch_norm(x, grm, grv, w, b, training=True, momentum=0.3)
        (y * _lay(g, placement, nd)).sum().backward()
    assert y.sbp == nd
    torch.testing.assert_close(y.full_tensor(), want, **TOL)
    for got, ref in ((x.grad, x_ref.grad), (w.grad, w_ref.grad), (b.grad, b_ref.grad), (grm, rm), (grv, rv)):
        torch.testing.assert_close(got.full_tensor(), ref, **TOL)
    assert x.grad.sbp == nd and w.grad.sbp == pc and grm.sbp == pc
    # only per-channel sums move: the forward's sum and squared deviations (C floats each), the
    # backward's two sums (2C); an all-reduce sends at most twice its payload, per position-split axis
    position_axes = sum(v.is_split and v.dim != 1 for v in nd)
    assert all(op == "all_reduce" for op in st.ops()), st.ops()
    assert st.bytes_sent <= position_axes * 2 * (6 + 6 + 12) * 8, st.bytes_sent
    assert (st.count == 0) == (position_axes == 0)


@pytest.mark.parametrize("placement,nd", LAYOUTS[:3], ids=[f"{p}-{n}" for p, n in LAYOUTS[:3]])
def test_eval_uses_the_running_statistics_without_communication(world4, placement, nd):
    rm, rv = torch.randn(6, dtype=torch.float64, generator=GEN), torch.rand(6, dtype=torch.float64, generator=GEN) + 1
    x_ref = X.clone().requires_grad_()
    w_ref = W.clone().requires_grad_()
    want = F.batch_norm(x_ref, rm, rv, w_ref, BIAS, training=False)
    want.sum().backward()
    pc = _per_channel(nd)
    x, w = _lay(X, placement, nd).requires_grad_(), _lay(W, placement, pc).requires_grad_()
    with no_fallback(), gt.comm_stats() as st:
        y = F.batch_norm(x, _lay(rm, placement, pc), _lay(rv, placement, pc), w, _lay(BIAS, placement, pc),
                         training=False)
        y.sum().backward()
        assert st.count == 0
    torch.testing.assert_close(y.full_tensor(), want, **TOL)
    torch.testing.assert_close(x.grad.full_tensor(), x_ref.grad, **TOL)
    torch.testing.assert_close(w.grad.full_tensor(), w_ref.grad, **TOL)


@pytest.mark.parametrize("op", ["legit", "no_stats", "functional", "no_training"])
def test_legit_variants(world4, op):
    rm, rv = torch.zeros(6, dtype=torch.float64), torch.ones(6, dtype=torch.float64)
    calls = {
        "legit": lambda x, w, b, m, v: aten._native_batch_norm_legit(x, w, b, m, v, True, 0.1, 1e-5),
        "no_stats": lambda x, w, b, m, v: aten._native_batch_norm_legit.no_stats(x, w, b, True, 0.1, 1e-5),
        "functional": lambda x, w, b, m, v: aten._native_batch_norm_legit_functional(x, w, b, m, v, True, 0.1, 1e-5),
        "no_training": lambda x, w, b, m, v: aten._native_batch_norm_legit_no_training(x, w, b, m, v + 1, 0.1, 1e-5),
    }
    ref_m, ref_v = rm.clone(), rv.clone()
    want = calls[op](X, W, BIAS, ref_m, ref_v)
    with no_fallback():
        args = [_lay(t, "1d", (S(0),) if t is X else (B,)) for t in (X, W, BIAS, rm, rv)]
        got = calls[op](*args)
    for i, (g, w) in enumerate(zip(got, want)):
        if w.numel():                       # eval gives empty saved statistics on one device
            torch.testing.assert_close(g.full_tensor(), w, **TOL, msg=lambda m: f"output {i}: {m}")
    # the running statistics written (legit) or left as they were (functional, no_training)
    torch.testing.assert_close(args[3].full_tensor(), ref_m, **TOL)
    torch.testing.assert_close(args[4].full_tensor(), ref_v, **TOL)


# -- running statistics in any layout: partial, split along the channels, broadcast ----------------

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
XU = torch.randn(7, 6, 5, dtype=torch.float64, generator=GEN) * 2 - 1      # 7 and 5: uneven splits
WU, BU = torch.rand(6, dtype=torch.float64, generator=GEN) + 0.5, torch.randn(6, dtype=torch.float64, generator=GEN)
RM, RV = torch.randn(6, dtype=torch.float64, generator=GEN), torch.rand(6, dtype=torch.float64, generator=GEN) + 0.5
CALLS = {   # (x, w, b, rm, rv, training) -> the normalised output
    "batch_norm": lambda x, w, b, m, v, t: F.batch_norm(x, m, v, w, b, training=t, momentum=0.3),
    "legit": lambda x, w, b, m, v, t: aten._native_batch_norm_legit(x, w, b, m, v, t, 0.3, 1e-5)[0],
}


def _sbp_of(kinds: list, dims: list, ndim: int) -> tuple:
    return tuple(S(d % ndim) if k == "S" else P if k == "P" else B for k, d in zip(kinds, dims))


@FAST
@given(placement=st.sampled_from(["1d", "2x2"]), call=st.sampled_from(sorted(CALLS)), training=st.booleans(),
       kinds=st.lists(st.lists(st.sampled_from("SPB"), min_size=2, max_size=2), min_size=5, max_size=5),
       dims=st.lists(st.integers(0, 2), min_size=2, max_size=2), seed=st.integers(0, 2 ** 16))
def test_running_statistics_in_any_layout_equal_one_device(placement, call, training, kinds, dims, seed):
    """Any layout of the input (split along any dim, broadcast) and of the weight, bias and
    running statistics (split along the channels, partial, broadcast -- each its own): the
    output, the gradients and the updated running statistics equal one device's, and the
    running statistics keep their layout. float64: the sums differ from one device's by their
    order only."""
    rng = random.Random(seed)
    n_axes = 1 if placement == "1d" else 2
    x_sbp = tuple(B if k == "P" else v for k, v in zip(kinds[0], _sbp_of(kinds[0], dims, 3)))[:n_axes]
    per_channel = [_sbp_of(k, [0, 0], 1)[:n_axes] for k in kinds[1:]]
    rm, rv = RM.clone(), RV.clone()
    refs = [t.clone().requires_grad_() for t in (XU, WU, BU)]
    want = CALLS[call](*refs, rm, rv, training)
    g = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    (want * g).sum().backward()
    with gt.simulate(4):
        pl = PLACEMENTS[placement]()
        x, w, b = (make_global(t, pl, nd, rng, requires_grad=True)
                   for t, nd in zip((XU, WU, BU), [x_sbp] + per_channel[:2]))
        grm, grv = (make_global(t, pl, nd, rng) for t, nd in zip((RM, RV), per_channel[2:]))
        with no_fallback():
            y = CALLS[call](x, w, b, grm, grv, training)
            (y * gt.distribute(g, pl, y.sbp)).sum().backward()
        torch.testing.assert_close(y.full_tensor(), want, **TOL)
        for name, got, ref in (("x.grad", x.grad, refs[0].grad), ("w.grad", w.grad, refs[1].grad),
                               ("b.grad", b.grad, refs[2].grad), ("running_mean", grm, rm), ("running_var", grv, rv)):
            torch.testing.assert_close(got.full_tensor(), ref, **TOL, msg=lambda m: f"{name}: {m}")
        assert (grm.sbp, grv.sbp) == tuple(per_channel[2:])


@pytest.mark.parametrize("running", [(P,), (S(0),)])
def test_partial_or_split_running_statistics_move_only_per_channel_sums(world4, running):
    """Batch-split input, running statistics partial or split along the channels: the update
    runs on each rank's piece, so the only communication is the batch statistics' all-reduce."""
    pl = PLACEMENTS["1d"]()
    x = make_global(X, pl, (S(0),), random.Random(0))
    rm, rv = (make_global(t, pl, running, random.Random(1)) for t in (torch.zeros(6, dtype=torch.float64),
                                                                      torch.ones(6, dtype=torch.float64)))
    want_m, want_v = torch.zeros(6, dtype=torch.float64), torch.ones(6, dtype=torch.float64)
    F.batch_norm(X, want_m, want_v, training=True, momentum=0.3)
    with no_fallback(), gt.comm_stats() as st:
        F.batch_norm(x, rm, rv, training=True, momentum=0.3)
    assert st.ops() == ["all_reduce", "all_reduce"] and st.bytes_sent <= 2 * (6 + 6) * 8, (st.ops(), st.bytes_sent)
    assert rm.sbp == running and rv.sbp == running
    torch.testing.assert_close(rm.full_tensor(), want_m, **TOL)
    torch.testing.assert_close(rv.full_tensor(), want_v, **TOL)
