"""1-D boxing on one placement: every pair of SBPs, values and bytes against DESIGN.md's table."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import globaltensor as gt
from globaltensor.boxing import plan_boxing
from globaltensor.boxing.layout import intersect
from globaltensor.sbp import numel

from boxing_helpers import B, P, S, check_pieces, layout, small_integers, make_pieces, nbytes, run_plan, sbp_values


def table_bound(src, dst) -> int:
    """DESIGN.md's lower bound for a 1-D boxing, exact for the balanced pieces of this shape."""
    x, y = src.nd_sbp[0], dst.nd_sbp[0]
    ranks = src.placement.rank_list()
    p = len(ranks)
    T = nbytes(src.shape, src.dtype)
    size = src.itemsize
    if x == y or p == 1:
        return 0
    if x.is_split and y.is_split:  # all-to-all: what a rank holds minus what it keeps
        return max(src.piece_bytes(r) - numel([l for _, l in intersect(src.box(r), dst.box(r)) or ()]) * size
                   if intersect(src.box(r), dst.box(r)) else src.piece_bytes(r) for r in ranks)
    if x.is_split and y.is_broadcast:  # all-gather
        return T - min(src.piece_bytes(r) for r in ranks)
    if x.is_partial and y.is_split:  # reduce-scatter
        return T - min(dst.piece_bytes(r) for r in ranks)
    if x.is_partial and y.is_broadcast:  # all-reduce
        return 2 * (T - (numel(src.shape) // p) * size)
    return 0


def even_formula(x, y, p, T):
    """The table's formula when every piece is the same size."""
    if x == y:
        return 0
    if x.is_split and y.is_split:
        return (p - 1) * T // (p * p)
    if x.is_split and y.is_broadcast or x.is_partial and y.is_split:
        return (p - 1) * T // p
    if x.is_partial and y.is_broadcast:
        return 2 * (p - 1) * T // p
    return 0


def expected_ops(x, y, p):
    if x == y:
        return []
    if x.is_split and y.is_split:
        return ["all_to_all"]
    if x.is_split and y.is_broadcast:
        return ["all_gather"]
    if x.is_partial and y.is_split:
        return ["reduce_scatter"]
    if x.is_partial and y.is_broadcast:
        return ["all_reduce"]
    return []


NAMES = {"B": B, "P": P, "S0": S(0), "S1": S(1), "S-1": S(-1)}


def _norm(v, ndim):
    return S(v.dim % ndim) if v.is_split else v


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("shape", [(8, 16), (7, 3), (3, 5), (0, 4)])
@pytest.mark.parametrize("x", ["B", "P", "S0", "S1"])
@pytest.mark.parametrize("y", ["B", "P", "S0", "S-1"])
def test_every_pair(x, y, shape, p):
    with gt.simulate(p):
        pl = gt.placement("cpu", list(range(p)))
        xs, ys = _norm(NAMES[x], len(shape)), _norm(NAMES[y], len(shape))
        src, dst = layout(shape, pl, xs), layout(shape, pl, ys)
        t = small_integers(shape, seed=p)
        plan, stats = run_plan(src, dst, t, seed=p)
        assert plan.bytes <= table_bound(src, dst)
        assert plan.bytes == table_bound(src, dst)  # the planner meets the bound exactly
        if p > 1:
            assert plan.collectives == expected_ops(xs, ys, p)
        if all(n % (p * p) == 0 for n in shape):
            assert plan.bytes == even_formula(xs, ys, p, nbytes(shape))


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_random_shapes_boxing_layer(data):
    """Every pair of 1-D SBPs for a random shape (0-3 dims of 0-9, often smaller than the ranks),
    1-8 ranks in a random order, a random dtype."""
    ndim = data.draw(st.integers(0, 3), label="ndim")
    shape = tuple(data.draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim), label="shape"))
    p = data.draw(st.integers(1, 8), label="p")
    dtype = data.draw(st.sampled_from([torch.float64, torch.float32, torch.int32]), label="dtype")
    with gt.simulate(p):
        ranks = data.draw(st.permutations(range(p)), label="ranks")
        pl = gt.placement("cpu", list(ranks))
        t = small_integers(shape, dtype, seed=p)
        for x in sbp_values(ndim):
            for y in sbp_values(ndim):
                src, dst = layout(shape, pl, x, dtype), layout(shape, pl, y, dtype)
                plan, _ = run_plan(src, dst, t, seed=ndim)
                assert plan.bytes == table_bound(src, dst), (x, y, plan)
                if x == y:
                    assert plan.steps == ()


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_random_shapes_to_global(data):
    """The same through the user API: gt.distribute, then x.to_global(sbp=...)."""
    ndim = data.draw(st.integers(0, 3), label="ndim")
    shape = tuple(data.draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim), label="shape"))
    p = data.draw(st.integers(1, 8), label="p")
    x = data.draw(st.sampled_from(sbp_values(ndim)), label="src")
    y = data.draw(st.sampled_from(sbp_values(ndim)), label="dst")
    with gt.simulate(p):
        pl = gt.placement("cpu", list(range(p)))
        t = small_integers(shape, seed=p)
        g = gt.distribute(t, pl, x)
        assert g.sbp == (x,) and tuple(g.shape) == shape and g.placement == pl
        src = layout(shape, pl, x)
        if x.is_partial:  # distribute keeps the value on the first rank, zeros elsewhere
            for r, piece in g.local_tensors().items():
                assert torch.equal(piece, t if r == 0 else torch.zeros_like(t))
        check_pieces(src, g.local_tensors(), t)
        expected = plan_boxing(src, layout(shape, pl, y))
        with gt.comm_stats() as st_:
            out = g.to_global(sbp=y)
        assert out.sbp == (y,) and tuple(out.shape) == shape
        check_pieces(layout(shape, pl, y), out.local_tensors(), t)
        assert st_.bytes_sent == expected.bytes
        # and from genuinely partial pieces
        if x.is_partial:
            g2 = gt.GlobalTensor(src, make_pieces(src, t, seed=p))
            with gt.comm_stats() as st2:
                out2 = g2.to_global(sbp=y)
            check_pieces(layout(shape, pl, y), out2.local_tensors(), t)
            assert st2.bytes_sent == expected.bytes <= table_bound(src, layout(shape, pl, y))


def test_s_to_b_uneven_example():
    """7 rows over 4 ranks: pieces of 2, 2, 2, 1 rows; ring all-gather: a rank passes on all but
    the next rank's piece, so the busiest sends 7 - 1 = 6 rows."""
    with gt.simulate(4):
        pl = gt.placement("cpu", [0, 1, 2, 3])
        t = small_integers((7, 3))
        x = gt.distribute(t, pl, S(0))
        assert [tuple(v.shape) for v in x.local_tensors().values()] == [(2, 3), (2, 3), (2, 3), (1, 3)]
        with gt.comm_stats() as st_:
            y = x.to_global(sbp=B)
        assert st_.ops() == ["all_gather"]
        assert st_.bytes_sent == 6 * 3 * 8
        for piece in y.local_tensors().values():
            assert torch.equal(piece, t)


def test_p_to_b_is_one_all_reduce():
    with gt.simulate(4):
        pl = gt.placement("cpu", [0, 1, 2, 3])
        t = small_integers((8, 4))
        src = layout(t.shape, pl, P)
        plan, st_ = run_plan(src, layout(t.shape, pl, B), t)
        assert st_.ops() == ["all_reduce"]
        assert plan.bytes == 2 * 3 * (32 // 4) * 8
