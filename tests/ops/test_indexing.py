"""Indexing rules (ops/rules/indexing.py): every candidate against one device, the splits that
survive, the partial (adding) scatters, and the data-dependent ops through the fallback."""
import random
import warnings

import pytest
import torch

import globaltensor as gt
from globaltensor.sbp import broadcast as B, partial_sum as P, split as S
from harness import PLACEMENTS, check_candidates, check_layouts, make_global, no_fallback, sigs

aten = torch.ops.aten
torch.manual_seed(0)

X3 = torch.randn(7, 5, 3)
X2 = torch.randn(7, 5)


def one_d(t, sbp, seed=0):
    return make_global(t, PLACEMENTS["1d"](), (sbp,), random.Random(seed))


# -- advanced indexing -----------------------------------------------------------------------

@pytest.mark.parametrize("indices", [
    [torch.tensor([[0, 2], [6, 1], [3, 3]])],                       # x[idx], a 2-D index
    [None, torch.tensor([4, 0, 1])],                                 # x[:, idx]
    [torch.tensor([1, 2]), None, torch.tensor([0, 2])],              # not adjacent: index dims go first
    [None, torch.tensor([[1], [2]]), torch.tensor([0, 2, 1])],       # two broadcasting indices
], ids=["2d-index", "second-dim", "split-apart", "broadcasting"])
def test_index_tensor_candidates(indices):
    assert check_candidates(aten.index.Tensor, X3, indices, placements=("1d",)) >= 3


def test_index_tensor_signatures():
    idx = torch.tensor([4, 0, 1])
    assert sigs(aten.index.Tensor, X3, [None, idx]) == {
        "S(0), B -> S(0)", "S(2), B -> S(2)", "B, S(0) -> S(1)", "P, B -> P"}
    # indices apart: the index dims lead the result, the kept dim 1 moves to 1 (after one index dim)
    assert sigs(aten.index.Tensor, X3, [idx, None, idx.clamp(max=2)]) == {
        "S(1), B, B -> S(1)", "B, S(0), S(0) -> S(0)", "P, B, B -> P"}


def test_index_keeps_split_of_other_dim_without_communication():
    idx = torch.tensor([4, 0, 1, 4])
    with gt.simulate(4):
        x = one_d(X2, S(0))
        with gt.comm_stats() as st:
            y = x[:, idx]
        assert y.sbp == (S(0),) and st.bytes_sent == 0
        torch.testing.assert_close(y.full_tensor(), X2[:, idx])
        # a split index splits the result; the indexed tensor is broadcast
        xb = one_d(X2, B)
        i = one_d(torch.tensor([6, 0, 3, 3, 1, 2]), S(0))
        z = xb[i]
        assert z.sbp == (S(0),)
        torch.testing.assert_close(z.full_tensor(), X2[torch.tensor([6, 0, 3, 3, 1, 2])])


def test_indexing_a_split_dim_is_correct():
    idx = torch.tensor([6, 0, 3, 3])
    check_layouts(lambda x: x[idx], X2, trials=4)
    check_layouts(lambda x: x[:, torch.tensor([4, 1])] * 2, X2, trials=4, grad=True)


# -- index_select / gather ---------------------------------------------------------------------

def test_index_select():
    idx = torch.tensor([4, 0, 1, 1])
    assert check_candidates(aten.index_select.default, X2, 1, idx) >= 4
    assert "B, S(0) -> S(1)" in sigs(aten.index_select.default, X2, 1, idx)
    check_layouts(lambda x: torch.index_select(x, 0, torch.tensor([6, 2, 2])), X2, trials=4, grad=True)


def test_gather():
    idx1 = torch.randint(0, 5, (7, 4))
    assert check_candidates(aten.gather.default, X2, 1, idx1) >= 4
    # off the gathered dim the index's row i reads x's row i: an index split there needs x split alike
    assert sigs(aten.gather.default, X2, 1, idx1) == {"S(0), S(0) -> S(0)", "B, S(1) -> S(1)", "P, B -> P"}
    idx0 = torch.randint(0, 7, (4, 5, 2))
    assert "B, S(0) -> S(0)" in sigs(aten.gather.default, X3, 0, idx0)
    assert check_candidates(aten.gather.default, X3, 0, idx0, placements=("1d",)) >= 3
    # a smaller index off the gathered dim: its pieces would not line up with x's
    assert "S(0), S(0) -> S(0)" not in sigs(aten.gather.default, X2, 1, torch.randint(0, 5, (3, 4)))


# -- scatters ----------------------------------------------------------------------------------

def test_scatter_overwrite_keeps_only_unindexed_splits():
    idx = torch.randint(0, 5, (7, 2))
    src = torch.randn(7, 2)
    assert sigs(aten.scatter.src, X2, 1, idx, src) == {"S(0), S(0), S(0) -> S(0)"}
    assert check_candidates(aten.scatter.src, X2, 1, torch.tensor([[0, 3]] * 7), src) >= 2
    assert check_candidates(aten.scatter.value, X2, 1, idx, 2.5) >= 2


def test_scatter_add_partial():
    idx = torch.randint(0, 7, (4, 5))
    src = torch.randn(4, 5)
    s = sigs(aten.scatter_add.default, X2, 0, idx, src)
    assert {"S(1), S(1), S(1) -> S(1)", "P, B, P -> P", "P, S(0), S(0) -> P"} <= s
    assert check_candidates(aten.scatter_add.default, X2, 0, idx, src) >= 6
    # a source longer than the index: their balanced pieces would not line up
    assert "P, S(0), S(0) -> P" not in sigs(aten.scatter_add.default, X2, 0, idx, torch.randn(6, 5))
    assert check_candidates(aten.scatter_add.default, X2, 0, idx, torch.randn(6, 5), max_2d=4) >= 2
    # off the scatter dim a split index has no partial candidate (it would write the wrong rows)
    idx1 = torch.randint(0, 5, (7, 4))
    assert "P, S(0), S(0) -> P" not in sigs(aten.scatter_add.default, X2, 1, idx1, torch.randn(7, 4))
    with gt.simulate(4):
        out = one_d(X2, P, seed=1)
        i, v = one_d(idx, S(0)), one_d(src, S(0))
        with gt.comm_stats() as st:
            y = out.scatter_add(0, i, v)
        assert y.sbp == (P,) and st.bytes_sent == 0
        torch.testing.assert_close(y.full_tensor(), X2.scatter_add(0, idx, src))


def test_scatter_reduce_sum_and_amax():
    idx = torch.randint(0, 7, (4, 5))
    src = torch.randn(4, 5)
    assert "P, B, P -> P" in sigs(aten.scatter_reduce.two, X2, 0, idx, src, "sum")
    assert "P, B, P -> P" not in sigs(aten.scatter_reduce.two, X2, 0, idx, src, "amax")
    assert "P, S(0), S(0) -> P" not in sigs(aten.scatter_reduce.two, X2, 0, idx, src, "sum", include_self=False)
    assert check_candidates(aten.scatter_reduce.two, X2, 0, idx, src, "sum", max_2d=6) >= 4
    assert check_candidates(aten.scatter_reduce.two, X2, 0, idx, src, "amax", include_self=False) >= 2


# -- index_put / index_add / index_copy / index_fill --------------------------------------------

def test_index_put_candidates():
    idx = torch.tensor([4, 0, 1])
    assert check_candidates(aten.index_put.default, X2, [None, idx], torch.randn(7, 3), True) >= 6
    assert check_candidates(aten.index_put.default, X2, [None, idx], torch.randn(7, 1), False) >= 2
    assert check_candidates(aten.index_put.default, X3, [torch.tensor([1, 5])], torch.randn(2, 5, 3), True,
                            placements=("1d",)) >= 4
    # overwriting is not linear: no partial candidate without accumulate
    assert not any("P" in s for s in sigs(aten.index_put.default, X2, [None, idx], torch.randn(7, 3), False))


def test_setitem_with_index_tensor_keeps_layout():
    idx = torch.tensor([4, 0])
    with gt.simulate(4):
        for sbp in (S(0), S(1), B, P):
            x = one_d(X2, sbp).clone()
            with warnings.catch_warnings():
                warnings.simplefilter("error")            # a rule, not the fallback
                x[:, idx] = torch.tensor([1.0, 2.0])
            want = X2.clone()
            want[:, idx] = torch.tensor([1.0, 2.0])
            assert x.sbp == (sbp,)
            torch.testing.assert_close(x.full_tensor(), want)
        # a split of the indexed dim: correct, through the functional op and a write-back
        x = one_d(X2, S(0)).clone()
        rows = torch.tensor([6, 1])
        x[rows] = 0.5
        want = X2.clone()
        want[rows] = 0.5
        assert x.sbp == (S(0),)
        torch.testing.assert_close(x.full_tensor(), want)


def test_setitem_with_boolean_mask_is_a_masked_fill():
    """``x[x > 0] = 0``: the mask is split like x, each rank fills its own elements."""
    assert check_candidates(aten.index_put.default, X2, [X2 > 0], torch.tensor(0.5), False) >= 2
    assert check_candidates(aten.index_put.default, X2, [X2[:, 0] > 0], torch.tensor(0.5), True) >= 3
    want = X2.clone()
    want[want > 0] = 0.0
    with gt.simulate(4):
        for sbp, placement in ((S(0), "1d"), (S(1), "1d"), ((S(1), S(0)), "2x2")):
            p = PLACEMENTS[placement]()
            x = make_global(X2, p, sbp if isinstance(sbp, tuple) else (sbp,), random.Random(0)).clone()
            with gt.comm_stats() as st:
                x[x > 0] = 0.0
            assert st.bytes_sent == 0 and x.sbp == (sbp if isinstance(sbp, tuple) else (sbp,))
            torch.testing.assert_close(x.full_tensor(), want)
        x = one_d(X2, P).clone()                 # a partial tensor: gathered, then written back
        x[x > 0] = 0.0
        assert x.sbp == (P,)
        torch.testing.assert_close(x.full_tensor(), want)


def test_index_put_accumulate_into_partial():
    """The embedding-gradient pattern: a split index adds its split rows into a partial buffer."""
    idx = torch.tensor([2, 5, 2, 0, 6, 2])
    vals = torch.randn(6, 5)
    want = torch.zeros(7, 5).index_put((idx,), vals, accumulate=True)
    with gt.simulate(4):
        buf = one_d(torch.zeros(7, 5), P)
        with gt.comm_stats() as st:
            buf.index_put_((one_d(idx, S(0)),), one_d(vals, S(0)), accumulate=True)
        assert buf.sbp == (P,) and st.bytes_sent == 0
        torch.testing.assert_close(buf.full_tensor(), want)


def test_index_add_copy_fill():
    idx = torch.tensor([4, 0, 1, 0])
    src = torch.randn(7, 4)
    s = sigs(aten.index_add.default, X2, 1, idx, src, alpha=2.0)
    assert {"S(0), B, S(0) -> S(0)", "P, B, P -> P", "P, S(0), S(1) -> P"} <= s
    assert check_candidates(aten.index_add.default, X2, 1, idx, src, alpha=2.0) >= 6
    assert check_candidates(aten.index_copy.default, X2, 1, torch.tensor([4, 0]), torch.randn(7, 2)) >= 2
    assert check_candidates(aten.index_fill.int_Scalar, X2, 1, torch.tensor([4, 0]), 2.5) >= 2
    assert not any("P" in s for s in sigs(aten.index_copy.default, X2, 1, torch.tensor([4, 0]), torch.randn(7, 2)))


def test_in_place_index_ops_keep_layout():
    idx = torch.tensor([4, 0, 1, 0])
    src = torch.randn(7, 4)
    with gt.simulate(4):
        for sbp in (S(0), S(1), P):
            x = one_d(X2, sbp).clone()
            x.index_add_(1, idx, one_d(src, S(0)), alpha=0.5)
            assert x.sbp == (sbp,)
            torch.testing.assert_close(x.full_tensor(), X2.index_add(1, idx, src, alpha=0.5))


# -- data-dependent shapes --------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:globaltensor")
def test_masked_select_and_nonzero_through_fallback():
    mask = X2 > 0
    check_layouts(lambda x: torch.masked_select(x, x > 0), X2, trials=3, partial=False)
    check_layouts(lambda x: torch.nonzero(x > 0), X2, trials=3, partial=False)
    check_layouts(lambda x: x[x > 0], X2, trials=3, partial=False)
    with gt.simulate(4):
        x = one_d(X2, S(0))
        m = one_d(mask, S(1))
        torch.testing.assert_close(x[m].full_tensor(), X2[mask])


def test_max_min_dim_backward_scatters_without_fallback():
    """The backward of max(dim) / min(dim) scatters the gradient into zeros (scatter.src): a split
    of another dim stays, and nothing falls back."""
    x0 = torch.randn(7, 5, 3)
    want = torch.autograd.grad((x0.requires_grad_(True).max(1).values * 2 + x0.min(2).values.sum()).sum(), x0)[0]
    with gt.simulate(4):
        x = make_global(x0.detach(), PLACEMENTS["2x2"](), (S(0), S(0)), random.Random(0), requires_grad=True)
        with no_fallback(), gt.comm_stats() as st:
            (x.max(1).values * 2 + x.min(2).values.sum()).sum().backward()
        assert x.grad.sbp == (S(0), S(0))
        assert "all_gather" not in " ".join(st.ops()), st.ops()
        torch.testing.assert_close(x.grad.full_tensor(), want)


@pytest.mark.parametrize("index_sbp", [B, P], ids=["B", "P"])
@pytest.mark.parametrize("x_sbp", [S(0), S(1), B], ids=["S0", "S1", "B"])
def test_tensor_split_by_a_global_0dim_tensor_equals_one_device(world4, x_sbp, index_sbp):
    """torch's C++ kernel of ``tensor_split(x, sections: Tensor)`` reads a 0-dim count with
    ``item()``: a collective read (ops/scalar_read.py), a partial count summed. (A 1-D index
    tensor it reads through its data pointer, above the dispatcher: see tests/conformance.)"""
    p = PLACEMENTS["1d"]()
    x = make_global(X2, p, (x_sbp,), random.Random(0))
    sections = make_global(torch.tensor(3), p, (index_sbp,), random.Random(1))
    with no_fallback():
        got = torch.tensor_split(x, sections)
    want = torch.tensor_split(X2, 3)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.full_tensor(), w, rtol=0, atol=0)
