"""gt.compile on forward passes: every compiled call equals the same eager call -- values, each
rank's piece, placement, SBP, and the gradients a backward inside the function leaves.

Boxing of every kind is covered (S->B, P->B, P->S, S(i)->S(j), B->S, to P; 2x2 nd-SBPs; across
placements), on uneven sizes and on ranks holding empty pieces, with hypothesis drawing shapes
and SBPs; plus random factories and dropout drawing the same numbers as the eager calls.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import globaltensor as gt
import globaltensor.nn as gnn
from globaltensor.tensor import GlobalTensor

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
TIGHT = dict(rtol=1e-12, atol=1e-12)


# -- helpers -----------------------------------------------------------------------------------
def assert_same(out, ref, *, exact: bool = True, what: str = "output") -> None:
    """``out`` (compiled) is ``ref`` (eager): a detached global tensor of the same layout whose
    every rank's piece equals ref's (exactly, or to float64 rounding)."""
    assert isinstance(out, GlobalTensor), f"{what}: expected a GlobalTensor, got {type(out).__name__}"
    assert out.placement == ref.placement, f"{what}: placement {out.placement} != eager {ref.placement}"
    assert out.sbp == ref.sbp, f"{what}: sbp {out.sbp} != eager {ref.sbp}"
    assert tuple(out.shape) == tuple(ref.shape) and out.dtype == ref.dtype, what
    mine, theirs = out.local_tensors(), ref.local_tensors()
    assert set(mine) == set(theirs), f"{what}: pieces on ranks {sorted(mine)} != eager {sorted(theirs)}"
    for r in theirs:
        a, b = mine[r].detach(), theirs[r].detach()
        assert a.shape == b.shape, f"{what}: rank {r}'s piece {tuple(a.shape)} != eager {tuple(b.shape)}"
        if exact:
            assert torch.equal(a, b), f"{what}: rank {r}'s piece differs from eager's:\n{a}\n{b}"
        else:
            torch.testing.assert_close(a, b, **TIGHT, msg=lambda m: f"{what}, rank {r}: {m}")
    if exact:
        assert torch.equal(out.full_tensor(), ref.full_tensor()), what


def compiled_matches_eager(fn, make_args, calls: int = 3, *, exact: bool = True, **compile_kw):
    """Compile ``fn`` and check ``calls`` calls on fresh arguments (same meta, new values) against
    eager calls of ``fn`` on the same arguments. Returns the compiled function."""
    compile_kw.setdefault("warmup", 0)
    g = gt.compile(fn, **compile_kw)
    for i in range(calls):
        args = make_args()
        ref = fn(*args)
        out = g(*args)
        assert_same(out, ref, exact=exact, what=f"call {i}")
    assert g.captures == 1, f"one meta, one capture; got {g.captures}"
    return g


def _rand(shape, placement, sbp):
    return lambda: (gt.randn(*shape, placement=placement, sbp=sbp),)


# -- boxing on one placement -------------------------------------------------------------------
BOXING_1D = [
    (S(0), B), (S(1), B), (P, B), (P, S(0)), (P, S(1)), (S(0), S(1)), (S(1), S(0)),
    (B, S(0)), (B, S(1)), (S(0), P), (B, P), (S(0), S(0)),
]


@pytest.mark.parametrize("shape", [(10, 7), (3, 5)], ids=["uneven", "empty-pieces"])
@pytest.mark.parametrize("src,dst", BOXING_1D, ids=[f"{a}->{b}" for a, b in BOXING_1D])
def test_boxing_1d(p1, shape, src, dst):
    compiled_matches_eager(lambda x: x.to_global(sbp=dst), _rand(shape, p1, src))


@pytest.mark.parametrize("src,dst", BOXING_1D[:7], ids=[f"{a}->{b}" for a, b in BOXING_1D[:7]])
def test_boxing_between_compute(p1, src, dst):
    """Ops before and after the boxing: the compiled graph orders them around the collective."""
    def fn(x):
        y = (x * 2.0).to_global(sbp=dst)
        return torch.sin(y) * 3.0 + y
    compiled_matches_eager(fn, _rand((10, 7), p1, src), exact=False)


BOXING_2D = [
    ((S(0), S(1)), (B, B)), ((S(0), B), (B, S(0))), ((P, S(0)), (B, B)), ((S(1), P), (S(0), S(1))),
    ((B, P), (S(0), B)), ((S(0), S(0)), (B, S(1))), ((P, P), (B, B)), ((S(0), S(1)), (S(1), S(0))),
    ((B, B), (S(1), S(0))), ((P, B), (S(0), P)),
]


@pytest.mark.parametrize("src,dst", BOXING_2D, ids=[f"{a}->{b}" for a, b in BOXING_2D])
def test_boxing_2x2(p2, src, dst):
    compiled_matches_eager(lambda x: x.to_global(sbp=dst), _rand((9, 7), p2, src))


# -- boxing across placements ------------------------------------------------------------------
ACROSS = {
    "subset-to-disjoint": ([0, 1], S(0), [2, 3], S(1)),
    "subset-to-all-B": ([0, 1], S(0), [0, 1, 2, 3], B),
    "all-to-subset-B": ([0, 1, 2, 3], S(0), [2, 3], B),
    "partial-to-disjoint": ([0, 1], P, [2, 3], S(0)),
    "overlapping": ([0, 1, 2], S(1), [1, 2, 3], S(0)),
    "1d-to-2x2": ([0, 1, 2, 3], S(1), [[0, 1], [2, 3]], (S(0), S(1))),
    "2x2-to-1d": ([[0, 1], [2, 3]], (S(0), B), [0, 1, 2, 3], S(1)),
    "2x2-to-other-hierarchy": ([[0, 1], [2, 3]], (S(0), S(1)), [[0, 2], [1, 3]], (S(1), B)),
}


@pytest.mark.parametrize("case", list(ACROSS))
def test_boxing_across_placements(world4, case):
    src_ranks, src, dst_ranks, dst = ACROSS[case]
    p_src, p_dst = gt.placement("cpu", src_ranks), gt.placement("cpu", dst_ranks)
    compiled_matches_eager(lambda x: x.to_global(placement=p_dst, sbp=dst), _rand((9, 7), p_src, src))


# -- hypothesis: shapes and SBPs ---------------------------------------------------------------
def _sbps(ndim: int):
    return st.one_of(st.just(B), st.just(P), st.integers(0, ndim - 1).map(S))


@st.composite
def boxings(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    two_d = draw(st.booleans())
    axes = 2 if two_d else 1
    src = tuple(draw(_sbps(ndim)) for _ in range(axes))
    dst = tuple(draw(_sbps(ndim)) for _ in range(axes))
    return shape, two_d, src, dst


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=boxings())
def test_boxing_hypothesis(p1, p2, case):
    shape, two_d, src, dst = case
    placement = p2 if two_d else p1
    compiled_matches_eager(lambda x: x.to_global(sbp=dst), _rand(shape, placement, src), calls=2)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(m=st.integers(1, 9), k=st.integers(1, 7), n=st.integers(1, 6),
       x_sbp=st.sampled_from([S(0), S(1), B]), w_sbp=st.sampled_from([S(0), S(1), B]))
def test_matmul_signatures_hypothesis(p1, m, k, n, x_sbp, w_sbp):
    """Whatever signature the matmul picks (S(0), P from S(1)@S(0), S(1)), the compiled call agrees."""
    def make():
        return gt.randn(m, k, placement=p1, sbp=x_sbp), gt.randn(k, n, placement=p1, sbp=w_sbp)

    def fn(x, w):
        y = x @ w
        return y, y.to_global(sbp=B)
    g = gt.compile(fn, warmup=0)
    for _ in range(2):
        args = make()
        (y_ref, b_ref), (y, b) = fn(*args), g(*args)
        assert_same(y, y_ref, exact=False, what="x @ w")
        assert_same(b, b_ref, exact=False, what="(x @ w) as B")


# -- a forward with parameters (state) ---------------------------------------------------------
@pytest.mark.parametrize("placement_name", ["p1", "p2"])
def test_tensor_parallel_mlp_forward(request, placement_name):
    """Column- then row-parallel linears (S(1) weights, then S(0): a partial sum), a softmax and a
    layer norm: parameters are state the graph reads; the argument changes every call."""
    placement = request.getfixturevalue(placement_name)
    nd = placement.ndim
    col, row = (S(1),) * nd if nd == 1 else (B, S(1)), (S(0),) if nd == 1 else (B, S(0))
    batch = (S(0),) if nd == 1 else (S(0), B)
    w1 = gt.randn(6, 10, placement=placement, sbp=col)
    w2 = gt.randn(10, 5, placement=placement, sbp=row)

    def fn(x):
        h = torch.nn.functional.gelu(x @ w1)
        y = h @ w2
        return torch.softmax(y, dim=-1) + torch.nn.functional.layer_norm(y, (5,))
    compiled_matches_eager(fn, _rand((7, 6), placement, batch), exact=False)


def test_megatron_module_forward(p2):
    """A gt.nn module distributed with a Megatron plan on 2x2, compiled as the function itself."""
    from nn_models import MEGATRON_2D, net
    m = gnn.distribute_module(net(), p2, MEGATRON_2D)
    with torch.no_grad():
        compiled_matches_eager(m, _rand((8, 6), p2, (S(0), B)), exact=False)


# -- gradients ---------------------------------------------------------------------------------
GRAD_CASES = {
    "S0->B": ("p1", S(0), lambda x, pl: x.to_global(sbp=B)),
    "S0->S1": ("p1", S(0), lambda x, pl: x.to_global(sbp=S(1))),
    "B->S1": ("p1", B, lambda x, pl: x.to_global(sbp=S(1))),
    "2x2": ("p2", (S(0), S(1)), lambda x, pl: x.to_global(sbp=(S(1), B))),
    "across": ("pa", S(1), lambda x, pl: x.to_global(placement=gt.placement("cpu", [2, 3]), sbp=B)),
}


@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_gradients_through_boxing(request, case):
    """A backward inside the function: the argument's .grad and the parameter's .grad equal eager's,
    with the SBP of the tensor they belong to."""
    placement_name, sbp, box = GRAD_CASES[case]
    placement = request.getfixturevalue(placement_name)
    torch.manual_seed(0)
    init = torch.randn(9, 7)

    def model():
        w = gt.distribute(init, placement, sbp).requires_grad_()
        opt = torch.optim.SGD([w], lr=0.1)

        def fn(x):
            opt.zero_grad()
            y = box(x * w, placement)
            loss = (y.sin() * y).sum()
            loss.backward()
            return loss.detach()
        return w, fn
    w_ref, eager = model()
    w, fn = model()
    g = gt.compile(fn)                    # warm-up call eager, then capture, then graph runs
    for i in range(4):
        x_ref = gt.randn(9, 7, placement=placement, sbp=sbp).requires_grad_()
        x = x_ref.detach().clone().requires_grad_()
        loss_ref, loss = eager(x_ref), g(x)
        assert_same(loss, loss_ref, exact=False, what=f"call {i} loss")
        assert not loss.requires_grad and loss.grad_fn is None, "outputs come back detached"
        assert x.grad is not None, f"call {i}: the argument's gradient is missing"
        assert_same(x.grad, x_ref.grad, exact=False, what=f"call {i}: x.grad")
        assert x.grad.sbp == x.sbp
        assert_same(w.grad, w_ref.grad, exact=False, what=f"call {i}: w.grad")
        assert w.grad.sbp == w.sbp
    assert g.captures == 1


# -- plain tensors and plain values ------------------------------------------------------------
def test_plain_tensor_and_keyword_arguments(p1):
    """A plain tensor argument is a placeholder (its values are read each call, not frozen); a
    keyword value is part of the meta."""
    def fn(x, t, scale=1.0):
        return (x * t).to_global(sbp=B) * scale
    g = gt.compile(fn, warmup=0)
    for _ in range(3):
        x, t = gt.randn(8, 3, placement=p1, sbp=S(0)), torch.randn(3)
        assert_same(g(x, t, scale=2.0), fn(x, t, scale=2.0))
    assert g.captures == 1
    assert_same(g(x, t, scale=3.0), fn(x, t, scale=3.0))
    assert g.captures == 2


def test_outputs_own_their_pieces(p1):
    """In-place ops on a compiled output act on it as on the eager output (no piece is shared
    between ranks or with the graph's next call)."""
    g = gt.compile(lambda x: (x.to_global(sbp=B), x.to_global(sbp=S(1))), warmup=0)
    for i in range(2):
        x = gt.randn(10, 7, placement=p1, sbp=P)
        (b, s), (b_ref, s_ref) = g(x), (x.to_global(sbp=B), x.to_global(sbp=S(1)))
        later = g(gt.randn(10, 7, placement=p1, sbp=P))      # a further call must not touch b, s
        del later
        for out, ref in ((b, b_ref), (s, s_ref)):
            out.add_(1.0)
            ref.add_(1.0)
            assert_same(out, ref, what=f"call {i}, after add_")


# -- random numbers ----------------------------------------------------------------------------
def _random_fn(placement, nd):
    def fn(x):
        noise = gt.randn(10, 7, placement=placement, sbp=(S(1),) * nd)
        u = gt.rand(5, placement=placement, sbp=(B,) * nd)
        return torch.nn.functional.dropout(x, 0.5) + noise, u
    return fn


@pytest.mark.parametrize("placement_name", ["p1", "p2"])
def test_random_factories_and_dropout_draw_the_eager_numbers(request, placement_name):
    placement = request.getfixturevalue(placement_name)
    nd = placement.ndim
    fn = _random_fn(placement, nd)
    xs = [gt.randn(10, 7, placement=placement, sbp=(S(0),) * nd) for _ in range(5)]
    gt.manual_seed(7)
    refs = [fn(x) for x in xs]
    after_ref = gt.randn(6, placement=placement, sbp=(B,) * nd).full_tensor()
    gt.manual_seed(7)
    g = gt.compile(fn)                               # call 0 eager, call 1 captures, 2-4 the graph
    outs = [g(x) for x in xs]
    after = gt.randn(6, placement=placement, sbp=(B,) * nd).full_tensor()
    for i, ((y, u), (y_ref, u_ref)) in enumerate(zip(outs, refs)):
        assert_same(y, y_ref, what=f"call {i}: dropout + randn")
        assert_same(u, u_ref, what=f"call {i}: rand")
    assert not torch.equal(outs[2][1].full_tensor(), outs[3][1].full_tensor()), "each call draws new numbers"
    assert torch.equal(after, after_ref), "after the compiled calls the random stream is where eager's is"


def test_random_numbers_in_a_pipeline(p1):
    fn = _random_fn(p1, 1)
    xs = [gt.randn(10, 7, placement=p1, sbp=S(0)) for _ in range(4)]
    gt.manual_seed(11)
    refs = [fn(x) for x in xs]
    gt.manual_seed(11)
    g = gt.compile(fn, warmup=0)
    for i, ((y, u), (y_ref, u_ref)) in enumerate(zip(g.pipeline(xs), refs)):
        assert_same(y, y_ref, what=f"item {i}")
        assert_same(u, u_ref, what=f"item {i}")


def test_blocked_splits_compile_like_eager(p1):
    """A fused q/k/v weight split in blocks and a 4-D matmul merging split heads (blocked
    splits, docs/concepts.md): the compiled call runs the same refactor reshapes, no collective
    before the final gather, and equals eager."""
    torch.manual_seed(0)
    x = gt.distribute(torch.randn(2, 5, 4, dtype=torch.float64), p1, B)
    w = gt.distribute(torch.randn(4, 24, dtype=torch.float64), p1, S(1, blocks=3))

    def attention(x):
        q, k, v = (t.view(2, 5, 4, 2).transpose(1, 2) for t in (x @ w).split(8, dim=2))
        return torch.matmul(torch.matmul(q, k.transpose(2, 3)).softmax(-1), v).to_global(sbp=B)

    compiled = gt.compile(attention)
    for _ in range(2):
        assert_same(compiled(x), attention(x), exact=False)
