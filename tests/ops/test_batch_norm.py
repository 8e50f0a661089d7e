"""Batch norm (ops/rules/batch_norm.py): batch, spatial and channel splits, 1-D and 2x2
placements, train and eval, forward and backward, the ``_native_batch_norm_legit*`` ops --
values and running statistics against one device (float64: exact up to the order of sums),
per-channel sums as the only communication, no fallback."""
import random

import pytest
import torch
import torch.nn.functional as F

import globaltensor as gt
from globaltensor.sbp import broadcast as B, split as S
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
    want = calls[op](X, W, BIAS, rm.clone(), rv.clone())
    with no_fallback():
        args = [_lay(t, "1d", (S(0),) if t is X else (B,)) for t in (X, W, BIAS, rm, rv)]
        got = calls[op](*args)
    for i, (g, w) in enumerate(zip(got, want)):
        if w.numel():                       # eval gives empty saved statistics on one device
            torch.testing.assert_close(g.full_tensor(), w, **TOL, msg=lambda m: f"output {i}: {m}")
