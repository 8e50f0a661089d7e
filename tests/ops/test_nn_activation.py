"""Softmax family, layer norm, activations and dropout on global tensors."""
import random

import pytest
import torch
import torch.nn.functional as F

import globaltensor as gt
from globaltensor.ops import rng
from globaltensor.ops.registry import find_rule
from globaltensor.sbp import broadcast, partial_sum, split
from harness import PLACEMENTS, check_candidates, check_layouts, make_global, no_fallback, sigs

aten = torch.ops.aten
S, B, P = split, broadcast, partial_sum
torch.manual_seed(0)


# -- softmax / log_softmax -------------------------------------------------------------------

@pytest.mark.parametrize("shape,dim", [((8, 6), -1), ((7, 5, 3), 1), ((3, 2), 0), ((2, 9, 5), 2)])
@pytest.mark.parametrize("op", [aten._softmax.default, aten._log_softmax.default])
def test_softmax_candidates(op, shape, dim):
    x = torch.randn(shape)
    assert sigs(op, x, dim, False) == {f"S({k}) -> S({k})" for k in range(len(shape))}, \
        "every dim, the softmax dim too (rules/softmax.py)"
    assert check_candidates(op, x, dim, False) >= len(shape)


@pytest.mark.parametrize("shape,dim", [((8, 6), -1), ((7, 5, 3), 1), ((3, 2), 0)])
@pytest.mark.parametrize("fwd,bwd", [(torch.softmax, aten._softmax_backward_data.default),
                                     (torch.log_softmax, aten._log_softmax_backward_data.default)])
def test_softmax_backward_candidates(fwd, bwd, shape, dim):
    x, g = torch.randn(shape), torch.randn(shape)
    y = fwd(x, dim)
    got = sigs(bwd, g, y, dim, torch.float32)
    d = dim % len(shape)
    assert "P, B -> P" in got and f"S({d}), S({d}) -> S({d})" in got
    assert check_candidates(bwd, g, y, dim, torch.float32) >= len(shape) + 1


@pytest.mark.parametrize("fn", [lambda x: torch.softmax(x, -1), lambda x: torch.log_softmax(x, -1),
                                lambda x: F.softmax(x * 2.0, dim=1)], ids=["softmax", "log_softmax", "softmax1"])
def test_softmax_random_layouts_with_grad(fn):
    check_layouts(fn, torch.randn(7, 6), grad=True, trials=4)


def test_softmax_keeps_split_and_gradient_layout():
    with gt.simulate(4):
        p = PLACEMENTS["2x2"]()
        x = make_global(torch.randn(6, 5, 4), p, (S(0), S(1)), random.Random(0), requires_grad=True)
        y = torch.log_softmax(x, -1)
        assert y.sbp == (S(0), S(1))
        with gt.comm_stats() as st:
            (y * 1.5).sum().backward()
        assert x.grad.sbp == (S(0), S(1))
        assert "all_gather" not in " ".join(st.ops())


# -- layer norm ------------------------------------------------------------------------------

LN_CASES = [((6, 4, 5), [5], True), ((5, 3, 4), [3, 4], False), ((3, 2, 5), [5], True), ((9, 7), [7], True)]


@pytest.mark.parametrize("shape,normalized,affine", LN_CASES)
def test_layer_norm_candidates(shape, normalized, affine):
    x = torch.randn(shape)
    w, b = (torch.randn(normalized), torch.randn(normalized)) if affine else (None, None)
    lead = len(shape) - len(normalized)
    affine_in = ", B, B" if affine else ""
    assert sigs(aten.native_layer_norm.default, x, normalized, w, b, 1e-5) == {
        f"S({d}){affine_in} -> S({d}), S({d}), S({d})" for d in range(lead)}
    assert check_candidates(aten.native_layer_norm.default, x, normalized, w, b, 1e-5) >= lead


@pytest.mark.parametrize("shape,normalized,affine", LN_CASES)
def test_layer_norm_backward_candidates(shape, normalized, affine):
    x, g = torch.randn(shape), torch.randn(shape)
    w, b = (torch.randn(normalized), torch.randn(normalized)) if affine else (None, None)
    _, mean, rstd = aten.native_layer_norm.default(x, normalized, w, b, 1e-5)
    mask = [True, affine, affine]
    args = (g, x, normalized, mean, rstd, w, b, mask)
    got = sigs(aten.native_layer_norm_backward.default, *args)
    lead = len(shape) - len(normalized)
    if affine:
        assert got == {f"S({d}), S({d}), S({d}), S({d}), B, B -> S({d}), P, P" for d in range(lead)} | {
            "P, B, B, B, B, B -> P, P, P"}
    else:
        assert got == {f"S({d}), S({d}), S({d}), S({d}) -> S({d})" for d in range(lead)} | {"P, B, B, B -> P"}
    assert check_candidates(aten.native_layer_norm_backward.default, *args) >= lead + 1


def test_layer_norm_backward_output_mask_subsets():
    """Only the grads asked for are outputs (the others are None and take no slot)."""
    x, g, w, b = torch.randn(6, 3, 5), torch.randn(6, 3, 5), torch.randn(5), torch.randn(5)
    _, mean, rstd = aten.native_layer_norm.default(x, [5], w, b, 1e-5)
    for mask, outs in (([True, False, True], "S(0), P"), ([False, True, False], "P")):
        args = (g, x, [5], mean, rstd, w, b, mask)
        assert f"S(0), S(0), S(0), S(0), B, B -> {outs}" in sigs(aten.native_layer_norm_backward.default, *args)
        check_candidates(aten.native_layer_norm_backward.default, *args)


def test_layer_norm_random_layouts_with_grad():
    def ln(x, w, b):
        return F.layer_norm(x, (5,), w, b)
    check_layouts(ln, torch.randn(6, 3, 5), torch.randn(5), torch.randn(5), grad=True, trials=4)


def test_layer_norm_split_batch_runs_without_gathering_activations():
    """x split on a leading dim: forward needs no communication; backward only reduces weight/bias grads."""
    with gt.simulate(4):
        p = PLACEMENTS["1d"]()
        r = random.Random(0)
        x0, w0, b0 = torch.randn(7, 3, 5), torch.randn(5), torch.randn(5)
        x = make_global(x0, p, (S(0),), r, requires_grad=True)
        w = make_global(w0, p, (B,), r, requires_grad=True)
        b = make_global(b0, p, (B,), r, requires_grad=True)
        with gt.comm_stats() as st:
            y = F.layer_norm(x, (5,), w, b)
        assert y.sbp == (S(0),) and st.bytes_sent == 0
        y.sum().backward()
        assert x.grad.sbp == (S(0),) and w.grad.sbp == (B,) and b.grad.sbp == (B,)
        xr, wr, br = (t.clone().requires_grad_(True) for t in (x0, w0, b0))
        F.layer_norm(xr, (5,), wr, br).sum().backward()
        for got, want in ((x.grad, xr.grad), (w.grad, wr.grad), (b.grad, br.grad)):
            torch.testing.assert_close(got.full_tensor(), want, rtol=1e-4, atol=1e-5)


def test_layer_norm_without_affine_backward_keeps_the_split():
    """No weight: the backward asks for grad_input alone (output_mask [True, False, False])."""
    with gt.simulate(4):
        p = PLACEMENTS["1d"]()
        x0 = torch.randn(6, 4, 5)
        x = make_global(x0, p, (S(0),), random.Random(0), requires_grad=True)
        y = F.layer_norm(x, (4, 5))
        assert y.sbp == (S(0),)
        with gt.comm_stats() as st:
            (y * 2.0).sum().backward()
        assert x.grad.sbp == (S(0),)
        assert "all_gather" not in " ".join(st.ops()), st.ops()
        xr = x0.clone().requires_grad_(True)
        (F.layer_norm(xr, (4, 5)) * 2.0).sum().backward()
        torch.testing.assert_close(x.grad.full_tensor(), xr.grad, rtol=1e-4, atol=1e-5)


# -- group norm ------------------------------------------------------------------------------

GN_CASES = [((6, 4, 5), 2, True), ((5, 6, 3, 2), 3, False), ((3, 4, 3), 2, True), ((7, 12), 2, True)]


def _gn_args(shape, groups, affine):
    x = torch.randn(shape)
    n, c = shape[0], shape[1]
    hw = x[0, 0].numel()
    w, b = (torch.randn(c), torch.randn(c)) if affine else (None, None)
    return x, w, b, (n, c, hw, groups, 1e-5)


@pytest.mark.parametrize("shape,groups,affine", GN_CASES)
def test_group_norm_candidates(shape, groups, affine):
    x, w, b, rest = _gn_args(shape, groups, affine)
    affine_in = ", B, B" if affine else ""
    assert sigs(aten.native_group_norm.default, x, w, b, *rest) == {f"S(0){affine_in} -> S(0), S(0), S(0)"}
    assert check_candidates(aten.native_group_norm.default, x, w, b, *rest) >= 1


@pytest.mark.parametrize("shape,groups,affine", GN_CASES)
@pytest.mark.parametrize("mask", [[True, True, True], [True, False, False], [False, True, True]], ids=str)
def test_group_norm_backward_candidates(shape, groups, affine, mask):
    x, w, b, (n, c, hw, g, eps) = _gn_args(shape, groups, affine)
    _, mean, rstd = aten.native_group_norm.default(x, w, b, n, c, hw, g, eps)
    mask = [mask[0], mask[1] and affine, mask[2] and affine]
    args = (torch.randn(shape), x, mean, rstd, w, n, c, hw, g, mask)
    outs = [v for v, there in zip(["S(0)", "P", "P"], mask) if there]
    affine_in = ", B" if affine else ""
    assert sigs(aten.native_group_norm_backward.default, *args) == {
        f"S(0), S(0), S(0), S(0){affine_in} -> {', '.join(outs)}", f"P, B, B, B{affine_in} -> {', '.join(['P'] * len(outs))}"}
    assert check_candidates(aten.native_group_norm_backward.default, *args) >= 2


def test_group_norm_random_layouts_with_grad():
    def gn(x, w, b):
        return F.group_norm(x, 2, w, b)
    check_layouts(gn, torch.randn(5, 4, 3, 2), torch.randn(4), torch.randn(4), grad=True, trials=4)


def test_group_norm_split_batch_moves_no_activation_and_falls_back_nowhere():
    x0, w0 = torch.randn(6, 4, 5, 3), torch.randn(4)
    xr, wr = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    (F.group_norm(xr, 2, wr) * 2.0).sum().backward()
    with gt.simulate(4):
        x = make_global(x0, PLACEMENTS["1d"](), (S(0),), random.Random(0), requires_grad=True)
        w = make_global(w0, PLACEMENTS["1d"](), (B,), random.Random(0), requires_grad=True)
        with no_fallback(), gt.comm_stats() as st:
            y = F.group_norm(x, 2, w)
            (y * 2.0).sum().backward()
        assert y.sbp == (S(0),) and x.grad.sbp == (S(0),)
        assert "all_gather" not in " ".join(st.ops()), st.ops()
        torch.testing.assert_close(y.full_tensor(), F.group_norm(x0, 2, w0))
        torch.testing.assert_close(x.grad.full_tensor(), xr.grad)
        torch.testing.assert_close(w.grad.full_tensor(), wr.grad)


# -- activations -----------------------------------------------------------------------------

ACTIVATIONS = [aten.gelu.default, aten.relu.default, aten.silu.default, aten.tanh.default, aten.sigmoid.default]
ACTIVATION_BACKWARDS = [
    (aten.threshold_backward.default, lambda g, x: (g, x, 0)),
    (aten.gelu_backward.default, lambda g, x: (g, x)),
    (aten.silu_backward.default, lambda g, x: (g, x)),
    (aten.tanh_backward.default, lambda g, x: (g, torch.tanh(x))),
    (aten.sigmoid_backward.default, lambda g, x: (g, torch.sigmoid(x))),
]


@pytest.mark.parametrize("op", ACTIVATIONS, ids=lambda o: str(o))
def test_activation_candidates(op):
    assert find_rule(op) is not None
    for shape in ((8, 6), (3, 5, 2)):
        assert check_candidates(op, torch.randn(shape), max_2d=4) >= len(shape)


@pytest.mark.parametrize("op,make", ACTIVATION_BACKWARDS, ids=[str(op) for op, _ in ACTIVATION_BACKWARDS])
def test_activation_backward_candidates(op, make):
    assert find_rule(op) is not None
    x, g = torch.randn(7, 3), torch.randn(7, 3)
    assert check_candidates(op, *make(g, x), max_2d=4) >= 2


def test_gelu_tanh_backward_candidates():
    x, g = torch.randn(5, 6), torch.randn(5, 6)
    check_candidates(aten.gelu.default, x, approximate="tanh", max_2d=4)
    check_candidates(aten.gelu_backward.default, g, x, approximate="tanh", max_2d=4)


@pytest.mark.parametrize("fn", [F.gelu, F.silu, lambda x: F.gelu(x, approximate="tanh"), torch.relu,
                                torch.tanh, torch.sigmoid], ids=["gelu", "silu", "gelu_tanh", "relu", "tanh", "sigmoid"])
def test_activation_random_layouts_with_grad(fn):
    check_layouts(fn, torch.randn(6, 5), grad=True, trials=3)


# -- dropout ---------------------------------------------------------------------------------

def _dropout_f(x, p):
    return F.dropout(x, p, training=True)


def _dropout_native(x, p):
    return aten.native_dropout.default(x, p, True)[0]


def _run_on(layouts, fn, x0, seed, **kw):
    """``fn`` on ``x0`` laid out as each (placement name, nd-sbp); the full outputs."""
    outs = []
    for name, nd in layouts:
        with gt.simulate(1 if name == "1rank" else 4):
            p = gt.placement("cpu", [0]) if name == "1rank" else PLACEMENTS[name]()
            x = make_global(x0, p, nd, random.Random(1))
            gt.manual_seed(seed)
            outs.append(fn(x, **kw).full_tensor())
    return outs


LAYOUTS = [("1rank", (B,)), ("1d", (S(0),)), ("1d", (S(1),)), ("1d", (B,)), ("2x2", (S(0), S(1))),
           ("2x2", (S(1), S(1))), ("2x2", (B, S(0)))]


@pytest.mark.parametrize("fn", [_dropout_f, _dropout_native], ids=["F.dropout", "native_dropout"])
def test_dropout_same_logical_mask_for_every_layout(fn):
    x0 = torch.randn(7, 6).abs() + 0.5
    outs = _run_on(LAYOUTS, fn, x0, seed=5, p=0.4)
    for (name, nd), out in zip(LAYOUTS[1:], outs[1:]):
        assert torch.equal(out, outs[0]), f"{name} {nd} differs from one rank"
    # partial inputs: the same mask, the output to float tolerance
    partial = _run_on([("1d", (P,)), ("2x2", (S(0), P))], fn, x0, seed=5, p=0.4)
    for out in partial:
        assert torch.equal(out == 0, outs[0] == 0)
        torch.testing.assert_close(out, outs[0])
    other_seed = _run_on(LAYOUTS[:1], fn, x0, seed=6, p=0.4)[0]
    assert not torch.equal(other_seed == 0, outs[0] == 0)


def test_cpu_and_cuda_dropout_paths_draw_the_same_mask():
    """F.dropout on CPU (bernoulli_) and native_dropout (CUDA's path) keep the same elements."""
    x0 = torch.randn(9, 5).abs() + 0.5
    a = _run_on([("1d", (S(1),))], _dropout_f, x0, seed=11, p=0.3)[0]
    b = _run_on([("2x2", (S(0), S(0)))], _dropout_native, x0, seed=11, p=0.3)[0]
    torch.testing.assert_close(a, b)


def test_dropout_rate_scaling_and_mask_output():
    p = 0.3
    x0 = torch.randn(100, 100).abs() + 0.5
    with gt.simulate(4):
        pl = PLACEMENTS["2x2"]()
        x = make_global(x0, pl, (S(0), S(1)), random.Random(0))
        gt.manual_seed(0)
        out, mask = aten.native_dropout.default(x, p, True)
        assert out.sbp == mask.sbp == (S(0), S(1)) and mask.dtype == torch.bool
        out, mask = out.full_tensor(), mask.full_tensor()
    dropped = (out == 0).float().mean().item()
    assert abs(dropped - p) < 0.03, dropped
    assert torch.equal(mask, out != 0)
    torch.testing.assert_close(out[mask], x0[mask] / (1 - p))


def test_dropout_backward_uses_the_same_mask():
    p = 0.5
    x0 = torch.randn(8, 7).abs() + 0.5
    weights = torch.linspace(0.5, 1.5, 56).reshape(8, 7)
    for fn in (_dropout_f, _dropout_native):
        with gt.simulate(4):
            pl = PLACEMENTS["2x2"]()
            x = make_global(x0, pl, (S(1), S(0)), random.Random(0), requires_grad=True)
            gt.manual_seed(2)
            out = fn(x, p)
            (out * gt.distribute(weights, pl, (S(1), S(0)))).sum().backward()
            assert x.grad.sbp == (S(1), S(0))
            kept = out.full_tensor().detach() != 0
            torch.testing.assert_close(x.grad.full_tensor(), weights * kept / (1 - p))
        assert 0 < kept.sum() < kept.numel()


def test_native_dropout_backward_candidates():
    g, mask = torch.randn(6, 5), torch.rand(6, 5) > 0.5
    got = sigs(aten.native_dropout_backward.default, g, mask, 2.0)
    assert {"S(0), S(0) -> S(0)", "S(1), S(1) -> S(1)", "P, B -> P"} <= got
    assert check_candidates(aten.native_dropout_backward.default, g, mask, 2.0) >= 3


def test_dropout_draws_only_each_ranks_piece_and_counters_agree(monkeypatch):
    """Each rank hashes only its piece's positions; a call reserves its counters once, so the
    next random factory gives the same tensor as on one rank."""
    drawn = []
    real = rng.uniform
    monkeypatch.setattr(rng, "uniform", lambda pos, *a, **k: drawn.append(pos.numel()) or real(pos, *a, **k))
    x0 = torch.randn(10, 6)
    after = []
    for n, nd in ((1, (B,)), (4, (S(0),))):
        drawn.clear()
        with gt.simulate(n):
            pl = gt.placement("cpu", list(range(n)))
            x = make_global(x0, pl, nd, random.Random(0))
            gt.manual_seed(9)
            F.dropout(x, 0.5, training=True)
            assert sum(drawn) == x0.numel(), drawn
            after.append(gt.rand(4, 3, placement=pl, sbp=B).full_tensor())
    assert torch.equal(after[0], after[1])


def test_dropout_eval_and_train_false_draw_nothing():
    x0 = torch.randn(6, 4)
    with gt.simulate(4):
        pl = PLACEMENTS["1d"]()
        x = make_global(x0, pl, (S(0),), random.Random(0))
        gt.manual_seed(3)
        first = gt.rand(5, placement=pl, sbp=B).full_tensor()
        gt.manual_seed(3)
        out, mask = aten.native_dropout.default(x, 0.5, False)
        assert torch.equal(out.full_tensor(), x0) and bool(mask.full_tensor().all())
        assert torch.equal(F.dropout(x, 0.5, training=False).full_tensor(), x0)
        assert torch.equal(gt.rand(5, placement=pl, sbp=B).full_tensor(), first)


@pytest.mark.parametrize("op,args", [(aten.bernoulli.p, (0.25,)), (aten.bernoulli.default, ())])
def test_bernoulli_is_sharding_invariant(op, args):
    x0 = torch.rand(40, 30) if not args else torch.zeros(40, 30)
    outs = _run_on(LAYOUTS, lambda x: op(x, *args), x0, seed=4)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    expected = args[0] if args else x0.mean().item()
    assert abs(outs[0].mean().item() - expected) < 0.05
