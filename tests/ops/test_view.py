"""View and shape rules (ops/rules/view.py): splits that survive, boxing where they cannot, and
writes through views (``x[2:5] = 0``) on every layout."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import globaltensor as gt
from globaltensor.sbp import balanced_sizes, broadcast as B, partial_sum as P, split as S
from harness import check_all, check_candidates, check_layouts, lay, no_fallback, sigs

aten = torch.ops.aten
torch.manual_seed(0)

X = torch.randn(7, 6)
X8 = torch.randn(8, 6)
X3 = torch.randn(5, 4, 3)
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])





# -- view / reshape --------------------------------------------------------------------------

def _lines_up(outer: int, inner: int, k: int = 4) -> bool:
    """[outer, inner, ...] split on dim 0 over k ranks, merged to [outer*inner, ...]: the pieces match."""
    return all(a * inner == b for a, b in zip(balanced_sizes(outer, k), balanced_sizes(outer * inner, k)))


@FAST
@given(b=st.integers(1, 9), t=st.integers(1, 4), d=st.integers(1, 3), merge=st.booleans())
def test_view_keeps_split_of_leading_dim_exactly_when_pieces_line_up(b, t, d, merge):
    full = torch.arange(b * t * d, dtype=torch.float32).reshape(b, t, d)
    src, dst = ((b, t, d), (b * t, d)) if merge else ((b * t, d), (b, t, d))
    with gt.simulate(4):
        x = lay(full.reshape(src), S(0))
        with gt.comm_stats() as stats:
            y = x.view(dst)
        assert torch.equal(y.full_tensor(), full.reshape(dst))
        if _lines_up(b, t):
            assert y.sbp == (S(0),), f"{src} -> {dst}: the split should survive"
            assert stats.bytes_sent == 0
        else:
            assert y.sbp != (S(0),) or stats.bytes_sent > 0, "a split that does not line up needs boxing"


@st.composite
def reshapes(draw):
    """A shape and a reshape of it that merges and splits adjacent dims."""
    dims = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    out, i = [], 0
    while i < len(dims):
        n = draw(st.integers(1, min(2, len(dims) - i)))
        size = 1
        for v in dims[i:i + n]:
            size *= v
        divisors = [f for f in range(1, size + 1) if size % f == 0]
        f = draw(st.sampled_from(divisors))
        out += [f, size // f] if draw(st.booleans()) and f not in (1, size) else [size]
        i += n
    return tuple(dims), tuple(out)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes=reshapes(), choice=st.integers(0, 10), two_d=st.booleans(), seed=st.integers(0, 3))
def test_reshape_any_layout(shapes, choice, two_d, seed):
    src, dst = shapes
    full = torch.randn(src)
    values = [B, P] + [S(d) for d in range(len(src))]
    sbp = (values[choice % len(values)], values[(choice * 7 + seed) % len(values)]) if two_d else \
        (values[choice % len(values)],)
    with gt.simulate(4):
        x = lay(full, sbp, "2x2" if two_d else "1d", seed)
        y = x.reshape(dst)
        torch.testing.assert_close(y.full_tensor(), full.reshape(dst))
        z = y.reshape(src) * 2      # and back, then a pointwise op on the result
        torch.testing.assert_close(z.full_tensor(), full * 2)


def test_view_candidates():
    # every candidate is forced, so these shapes line up on both placements
    check_all(aten.view.default, torch.randn(4, 6, 5), [24, 5], placements=("1d",))
    check_all(aten.view.default, torch.randn(4, 16, 5), [4, 4, 4, 5], placements=("1d",))
    check_all(aten.view.default, X8, [48], max_2d=6)
    check_all(aten._unsafe_view.default, X8, [4, 12], max_2d=6)
    assert "S(0) -> S(0)" in sigs(aten.view.default, torch.randn(8, 6), [48])


def test_view_of_non_contiguous_pieces():
    """The global tensor is contiguous after a transpose; its pieces are not."""
    def fn(x):
        return x.t().reshape(-1), x.transpose(0, 1).reshape(3, 14), x.t().flatten(), x.t().contiguous().view(42)
    check_layouts(fn, X, trials=4, grad=True)

    def attention_heads(x):     # [b, t, h*d] -> [b, h, t, d] -> [b*h, t, d]
        return x.view(2, 4, 3, 2).transpose(1, 2).reshape(6, 4, 2).sum(-1)
    check_layouts(attention_heads, torch.randn(2, 4, 6), trials=4, grad=True, placements=("1d",))


# -- permutations, squeeze, expand ------------------------------------------------------------

def test_transpose_permute_t():
    check_all(aten.transpose.int, X3, 0, -1, placements=("1d",))
    check_all(aten.permute.default, X3, [2, 0, 1], placements=("1d",))
    check_all(aten.t.default, X, max_2d=6)
    assert check_candidates(aten.t.default, torch.randn(5)) > 0
    assert sigs(aten.permute.default, X3, [2, 0, 1]) == {"S(0) -> S(1)", "S(1) -> S(2)", "S(2) -> S(0)", "P -> P"}


def test_unsqueeze_squeeze():
    x = torch.randn(5, 1, 3)
    check_all(aten.unsqueeze.default, x, -1, placements=("1d",))
    check_all(aten.squeeze.dim, x, 1, placements=("1d",))
    check_all(aten.squeeze.dims, x, [0, 1], placements=("1d",))
    check_all(aten.squeeze.default, torch.randn(8, 1, 8), placements=("1d",))


def test_squeeze_only_removes_global_size_one():
    """A split dim of 4 over 4 ranks has pieces of size 1: squeezing must not remove them."""
    t = torch.randn(4, 1, 6)
    with gt.simulate(4):
        for sbp in (S(0), (S(0),)):
            x = lay(t, sbp)
            for fn in (lambda v: v.squeeze(), lambda v: v.squeeze(0), lambda v: v.squeeze((0, 1)),
                       lambda v: v.squeeze(1), lambda v: v.squeeze(-1)):
                y = fn(x)
                assert tuple(y.shape) == tuple(fn(t).shape)
                torch.testing.assert_close(y.full_tensor(), fn(t))
        # squeeze.dim of a kept split dim: no communication, still a split
        with gt.comm_stats() as stats:
            y = lay(t, S(0)).squeeze(0)
        assert y.sbp == (S(0),) and stats.bytes_sent == 0


def test_expand():
    x = torch.randn(5, 1, 3)
    check_all(aten.expand.default, x, [2, 5, 4, 3], placements=("1d",))
    check_all(aten.expand.default, x, [-1, 4, -1], placements=("1d",))
    check_layouts(lambda v: v[:, None, :].expand(-1, 3, -1) * 1.5, X, trials=4, grad=True)


# -- slicing ---------------------------------------------------------------------------------

def test_slice_candidates():
    # the candidate keeping a split of the sliced dim is forced too: slices whose pieces line up
    check_all(aten.slice.Tensor, X, 1, 0, None, 2, max_2d=6)
    check_all(aten.slice.Tensor, X8, 0, None, None, 2, max_2d=6)
    check_all(aten.slice.Tensor, X8, 0, 1, 8, 2, max_2d=6)
    check_all(aten.slice.Tensor, X3, -1, 0, 2, placements=("1d",))
    assert check_candidates(aten.select.int, X, 1, -1, max_2d=6) >= 2
    assert check_candidates(aten.select.int, X3, 0, 3, placements=("1d",)) >= 3
    assert check_candidates(aten.split.Tensor, X, 4, 1, max_2d=6) >= 2
    assert check_candidates(aten.split_with_sizes.default, X, [2, 5], 0, max_2d=6) >= 2
    assert check_candidates(aten.unbind.int, X3, 1, placements=("1d",)) >= 3


@pytest.mark.parametrize("n,sl,keeps", [
    (8, slice(None, None, 2), True),      # one in two rows of each rank's even piece
    (8, slice(1, None, 2), True),
    (7, slice(None, None, 2), True),      # uneven pieces 2,2,2,1 -> 1,1,1,1
    (8, slice(2, 5), False),              # parts 0,2,1,0 are not the balanced 1,1,1,0
    (8, slice(0, 4), False),
    (8, slice(-3, None), False),
    (9, slice(1, 8, 3), False),
    (8, slice(5, 2), True),               # empty
])
def test_slice_along_split_dim(n, sl, keeps):
    t = torch.randn(n, 3)
    with gt.simulate(4):
        x = lay(t, S(0))
        with gt.comm_stats() as stats:
            y = x[sl]
        torch.testing.assert_close(y.full_tensor(), t[sl])
        if keeps:
            assert y.sbp == (S(0),) and stats.bytes_sent == 0
        else:
            assert y.sbp != (S(0),) or stats.bytes_sent > 0, "a split that does not line up needs boxing"


def test_slice_along_split_dim_2d_placement():
    t = torch.randn(8, 6)
    with gt.simulate(4):
        for sbp in ((S(0), S(0)), (S(0), S(1)), (S(1), S(0)), (P, S(0))):
            x = lay(t, sbp, "2x2")
            for sl in (slice(None, None, 2), slice(2, 5), slice(1, 8, 3)):
                torch.testing.assert_close(x[sl].full_tensor(), t[sl])
                torch.testing.assert_close(x[:, sl].full_tensor(), t[:, sl])
        x = lay(t, (S(0), S(0)), "2x2")
        with gt.comm_stats() as stats:
            y = x[::2]          # 8 rows over 2x2: pieces of 2 rows, one taken from each
        assert y.sbp == (S(0), S(0)) and stats.bytes_sent == 0


def test_basic_indexing():
    def fn(x):
        return x[1], x[:, 2:5], x[..., None], x[None], x[1, ::2], x[-1:, 1], x[:, -1]
    check_layouts(fn, X, trials=5)
    check_layouts(lambda x: x[2:, 1:4] * 3, X, trials=4, grad=True)


def test_flip():
    check_all(aten.flip.default, X3, [0, 2], placements=("1d",))
    with gt.simulate(4):
        x = lay(X, S(0))
        with gt.comm_stats() as stats:
            y = x.flip(1)
        assert y.sbp == (S(0),) and stats.bytes_sent == 0
        torch.testing.assert_close(y.full_tensor(), X.flip(1))
        torch.testing.assert_close(x.flip(0, 1).full_tensor(), X.flip(0, 1))


def test_constant_pad_nd():
    assert sigs(aten.constant_pad_nd.default, X3, [1, 2]) == {"S(0) -> S(0)", "S(1) -> S(1)", "P -> P"}
    assert sigs(aten.constant_pad_nd.default, X3, [0, 0, 2, 0], 1.5) == {"S(0) -> S(0)", "S(2) -> S(2)"}
    assert check_all(aten.constant_pad_nd.default, X3, [1, 2], max_2d=6) >= 3
    assert check_all(aten.constant_pad_nd.default, X3, [0, 0, -1, 2], 0.5, max_2d=6) >= 2
    check_layouts(lambda x: torch.nn.functional.pad(x, (2, 1)) * 2, X, trials=4, grad=True)
    with gt.simulate(4):
        x = lay(X, S(0))
        with no_fallback(), gt.comm_stats() as stats:
            y = torch.nn.functional.pad(x, (1, 3), value=-1.0)
        assert y.sbp == (S(0),) and stats.bytes_sent == 0
        torch.testing.assert_close(y.full_tensor(), torch.nn.functional.pad(X, (1, 3), value=-1.0))


@FAST
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=3),
       pads=st.lists(st.integers(-1, 2), min_size=2, max_size=6), value=st.sampled_from([0.0, 2.5]))
def test_constant_pad_nd_any_pads(shape, pads, value):
    pads = pads[:2 * len(shape)]
    pads = pads[:len(pads) - len(pads) % 2]
    x = torch.randn(shape)
    if any(n + a + b <= 0 for n, a, b in zip(reversed(shape), pads[::2], pads[1::2])):
        return                                   # cropped to nothing: torch refuses
    if sigs(aten.constant_pad_nd.default, x, pads, value):
        check_candidates(aten.constant_pad_nd.default, x, pads, value, placements=("1d",))
    check_layouts(lambda t: aten.constant_pad_nd.default(t, pads, value), x, trials=2, placements=("1d",))


def test_unfold_and_backward():
    assert sigs(aten.unfold.default, X3, 1, 2, 1) == {"S(0) -> S(0)", "S(2) -> S(2)", "P -> P"}
    assert check_all(aten.unfold.default, X3, 1, 2, 1, max_2d=6) >= 3
    assert check_all(aten.unfold.default, X3, -1, 2, 2, max_2d=6) >= 3
    g = torch.randn(5, 3, 3, 2)                  # the gradient of X3.unfold(1, 2, 1)
    assert sigs(aten.unfold_backward.default, g, [5, 4, 3], 1, 2, 1) == {"S(0) -> S(0)", "S(2) -> S(2)", "P -> P"}
    assert check_all(aten.unfold_backward.default, g, [5, 4, 3], 1, 2, 1, max_2d=6) >= 3
    check_layouts(lambda x: x.unfold(1, 3, 2) * 2, X, trials=4, grad=True)
    check_layouts(lambda x: x.unfold(0, 2, 1).sum(-1), X3, trials=4, grad=True)
    with gt.simulate(4):
        x = lay(X3, S(2)).requires_grad_(True)
        with no_fallback():
            y = x.unfold(1, 2, 1)
            y.sum().backward()
        assert y.sbp == (S(2),) and x.grad.sbp == (S(2),)


def test_diagonal_and_backward():
    x = torch.randn(4, 5, 3, 6)
    assert sigs(aten.diagonal.default, x, 0, 1, 3) == {"S(0) -> S(0)", "S(2) -> S(1)", "P -> P"}
    assert sigs(aten.diagonal.default, x, 1, -1, 0) == {"S(1) -> S(0)", "S(2) -> S(1)", "P -> P"}
    assert check_all(aten.diagonal.default, x, 0, 1, 3, max_2d=6) >= 3
    assert check_all(aten.diagonal.default, x, -2, 2, 0, max_2d=6) >= 3
    g = torch.randn(4, 3, 5)                     # the gradient of x.diagonal(0, 1, 3)
    assert sigs(aten.diagonal_backward.default, g, [4, 5, 3, 6], 0, 1, 3) == {"S(0) -> S(0)", "S(1) -> S(2)", "P -> P"}
    assert check_all(aten.diagonal_backward.default, g, [4, 5, 3, 6], 0, 1, 3, max_2d=6) >= 3
    check_layouts(lambda t: t.diagonal(1, 1, 2) * 2, X3, trials=4, grad=True)
    check_layouts(lambda t: torch.diagonal(t) + 1, X, trials=4, grad=True)
    with gt.simulate(4):
        t = lay(X3, S(0)).requires_grad_(True)
        with no_fallback(), gt.comm_stats() as stats:
            y = t.diagonal(0, 1, 2)
            y.sum().backward()
        assert y.sbp == (S(0),) and t.grad.sbp == (S(0),) and stats.bytes_sent == 0


def test_narrow_chunk_split_unbind_flatten():
    def fn(x):
        return (x.narrow(1, 1, 4), x.chunk(3, 0), x.chunk(2, 1), x.split([2, 5]), x.unbind(1),
                x.view(7, 2, 3).flatten(1), x.contiguous(), x.clone(), x.detach(), torch.flatten(x))
    check_layouts(fn, X, trials=5)


def test_unbind_along_split_dim_gathers_once():
    t = torch.randn(4, 64)
    with gt.simulate(4):
        x = lay(t, S(0))
        with gt.comm_stats() as one_gather:
            x.to_global(sbp=B)
        with gt.comm_stats() as stats:
            rows = x.unbind(0)
        assert stats.bytes_sent <= one_gather.bytes_sent
        for i, r in enumerate(rows):
            torch.testing.assert_close(r.full_tensor(), t[i])


# -- joining ---------------------------------------------------------------------------------

def test_cat_stack():
    a, b = torch.randn(5, 3), torch.randn(2, 3)
    assert check_candidates(aten.cat.default, [a, b], 0, max_2d=6) >= 2
    assert check_candidates(aten.cat.default, [a, a * 2], 1, max_2d=6) >= 2
    assert check_candidates(aten.stack.default, [a, a + 1, a * 2], 1, max_2d=6) >= 3
    check_layouts(lambda x, y: (torch.cat([x, y], 0), torch.cat([x, x * 2], 1), torch.stack([x, x])), a, b,
                  trials=5)
    with gt.simulate(4):
        x = lay(a, S(1))
        with gt.comm_stats() as stats:
            y = torch.cat([x, lay(b, S(1))], 0)
        assert y.sbp == (S(1),) and stats.bytes_sent == 0


# -- writes through views --------------------------------------------------------------------

def _writes(x):
    x[2:5] = 0.5                # slice along dim 0, then copy_
    x[:, 1] = 3.0               # select along dim 1
    x[1:3].add_(1.0)            # in-place on a slice
    x[::2, 2:4] *= 2            # a slice of a slice
    x[5][1:3] = -1.0            # a view of a view
    x.view(-1)[::7] = 9.0       # through a reshape
    x.t()[0, 4] = 8.0           # through a transpose
    x.chunk(2, 0)[1][0] = 4.0   # one output of a multi-output view, then a select
    x.unbind(1)[2].mul_(0.5)
    return x


@pytest.mark.parametrize("sbp,placement", [
    (S(0), "1d"), (S(1), "1d"), (P, "1d"), (B, "1d"), ((S(0), S(1)), "2x2"), ((P, S(0)), "2x2"),
])
def test_writes_through_views_reach_the_base(sbp, placement):
    t = torch.randn(7, 6)
    want = _writes(t.clone())
    with gt.simulate(4):
        x = lay(t, sbp, placement).clone()      # clone: a tensor of its own on every rank
        before = x.sbp
        _writes(x)
        assert x.sbp == before
        torch.testing.assert_close(x.full_tensor(), want)


@pytest.mark.filterwarnings("ignore:globaltensor")
def test_write_into_fallback_view():
    t = torch.randn(5, 5)
    want = t.clone()
    want.diagonal().fill_(0.0)
    with gt.simulate(4):
        x = lay(t, S(0)).clone()
        x.diagonal().fill_(0.0)          # diagonal runs through the fallback (as_strided)
        torch.testing.assert_close(x.full_tensor(), want)


def test_in_place_on_exact_slice_is_a_true_view():
    """A slice whose split survives is made of views of the base's pieces: no write-back needed."""
    t = torch.randn(8, 3)
    with gt.simulate(4):
        x = lay(t, S(0)).clone()
        y = x[::2]
        assert getattr(y, "_view_of", None) is None
        with gt.comm_stats() as stats:
            y.mul_(0)
        assert stats.bytes_sent == 0
        want = t.clone()
        want[::2] = 0
        torch.testing.assert_close(x.full_tensor(), want)
