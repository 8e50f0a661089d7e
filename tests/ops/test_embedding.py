"""Embedding lookups and the weight gradient on global tensors, the vocabulary split included."""
import random

import pytest
import torch
import torch.nn.functional as F

import globaltensor as gt
from globaltensor.sbp import broadcast, partial_sum, split
from harness import PLACEMENTS, check_candidates, check_layouts, make_global, no_fallback, sigs

aten = torch.ops.aten
S, B, P = split, broadcast, partial_sum
torch.manual_seed(0)

# (vocab, dim, indices shape, padding_idx): even, uneven, a vocabulary / dims smaller than 4 ranks
CASES = [(12, 8, (4, 6), -1), (13, 5, (2, 3, 5), 2), (3, 2, (7,), -1), (10, 3, (3, 2), 9)]


def _ids(vocab, shape, padding_idx):
    ids = torch.randint(0, vocab, shape)
    if padding_idx >= 0:
        ids.view(-1)[::3] = padding_idx
    return ids


@pytest.mark.parametrize("vocab,dim,shape,padding_idx", CASES)
def test_embedding_candidates(vocab, dim, shape, padding_idx):
    w, ids = torch.randn(vocab, dim), _ids(vocab, shape, padding_idx)
    n = len(shape)
    assert sigs(aten.embedding.default, w, ids, padding_idx) == (
        {f"B, S({d}) -> S({d})" for d in range(n)} | {f"S(1), B -> S({n})", "S(0), B -> P", "P, B -> P"})
    assert check_candidates(aten.embedding.default, w, ids, padding_idx) >= n + 3


@pytest.mark.parametrize("vocab,dim,shape,padding_idx", CASES)
@pytest.mark.parametrize("freq", [False, True], ids=["plain", "scale_grad_by_freq"])
def test_embedding_dense_backward_candidates(vocab, dim, shape, padding_idx, freq):
    ids = _ids(vocab, shape, padding_idx)
    ids.view(-1)[1::4] = ids.view(-1)[0]  # repeated ids, so frequency scaling matters
    g = torch.randn(shape + (dim,))
    args = (g, ids, vocab, padding_idx, freq)
    n = len(shape)
    want = {f"S({n}), B -> S(1)", "B, B -> S(0)", "P, B -> P"}
    if not freq:  # split indices would count frequencies locally
        want |= {f"S({d}), S({d}) -> P" for d in range(n)}
    assert sigs(aten.embedding_dense_backward.default, *args) == want
    assert check_candidates(aten.embedding_dense_backward.default, *args) >= len(want)


@pytest.mark.parametrize("padding_idx,freq", [(None, False), (1, True)])
def test_embedding_random_layouts_with_grad(padding_idx, freq):
    def lookup(w, ids):
        return F.embedding(ids, w, padding_idx=padding_idx, scale_grad_by_freq=freq)
    ids = torch.tensor([[1, 4, 1, 6], [6, 0, 2, 1], [3, 3, 5, 1]])
    check_layouts(lookup, torch.randn(7, 5), ids, grad=True, trials=5)


@pytest.mark.parametrize("name,nd", [("1d", (S(0),)), ("2x2", (S(0), S(1))), ("2x2", (S(0), S(0)))])
def test_vocab_split_weight_keeps_its_layout_forward_and_backward(name, nd):
    """A vocabulary-split table: the lookup is a partial sum with no communication, and the
    weight's gradient comes in the weight's layout, with no communication either."""
    vocab, dim = 11, 6
    w0 = torch.randn(vocab, dim)
    ids = torch.tensor([[0, 10, 3, 3], [7, 5, 10, 2], [1, 9, 4, 6]])
    weights = torch.linspace(0.5, 1.5, ids.numel() * dim).reshape(3, 4, dim)
    wr = w0.clone().requires_grad_(True)
    want = F.embedding(ids, wr, padding_idx=5)
    (want * weights).sum().backward()
    with gt.simulate(4):
        p = PLACEMENTS[name]()
        w = make_global(w0, p, nd, random.Random(0), requires_grad=True)
        with gt.comm_stats() as st:
            out = F.embedding(ids, w, padding_idx=5)
        assert st.count == 0
        assert out.sbp[0] == P
        torch.testing.assert_close(out.full_tensor(), want)
        loss = (out * weights).sum()
        with gt.comm_stats() as st:
            loss.backward()
        assert st.count == 0, st.ops()
        assert w.grad.sbp == nd
        torch.testing.assert_close(w.grad.full_tensor(), wr.grad)


def test_split_indices_with_broadcast_table():
    """Data parallel lookup: indices split, table broadcast; the table's gradient is reduced."""
    w0 = torch.randn(9, 4)
    ids = torch.randint(0, 9, (6, 5))
    wr = w0.clone().requires_grad_(True)
    F.embedding(ids, wr).sum().backward()
    with gt.simulate(4):
        p = PLACEMENTS["2x2"]()
        w = make_global(w0, p, (B, B), random.Random(0), requires_grad=True)
        idx = make_global(ids, p, (S(0), S(1)), random.Random(0))
        with gt.comm_stats() as st:
            out = F.embedding(idx, w)
        assert out.sbp == (S(0), S(1)) and st.count == 0
        out.sum().backward()
        assert w.grad.sbp == (B, B)
        torch.testing.assert_close(w.grad.full_tensor(), wr.grad)


def test_embedding_dim_split_table():
    """Table split along the embedding dim: the output is split along its last dim."""
    w0 = torch.randn(8, 6)
    ids = torch.randint(0, 8, (3, 4))
    wr = w0.clone().requires_grad_(True)
    F.embedding(ids, wr, scale_grad_by_freq=True).pow(2).sum().backward()
    with gt.simulate(4):
        p = PLACEMENTS["1d"]()
        w = make_global(w0, p, (S(1),), random.Random(0), requires_grad=True)
        out = F.embedding(ids, w, scale_grad_by_freq=True)
        assert out.sbp == (S(2),)
        with gt.comm_stats() as st:
            out.pow(2).sum().backward()
        assert w.grad.sbp == (S(1),) and st.count == 0
        torch.testing.assert_close(w.grad.full_tensor(), wr.grad)


# -- max_norm: embedding_renorm_ ----------------------------------------------------------------

@pytest.mark.parametrize("vocab,dim,shape,padding_idx", CASES)
@pytest.mark.parametrize("norm_type", [2.0, 1.0])
def test_embedding_renorm_candidates(vocab, dim, shape, padding_idx, norm_type):
    w, ids = torch.randn(vocab, dim) * 2, _ids(vocab, shape, padding_idx)
    assert sigs(aten.embedding_renorm.default, w, ids, 1.0, norm_type) == {"S(0), B -> S(0)"}
    assert check_candidates(aten.embedding_renorm.default, w, ids, 1.0, norm_type) >= 1


@pytest.mark.parametrize("name,nd", [("1d", (S(0),)), ("1d", (S(1),)), ("1d", (B,)),
                                     ("2x2", (S(0), S(0))), ("2x2", (S(0), S(1))), ("2x2", (B, S(0)))])
def test_max_norm_renorms_the_weight_in_place_in_its_layout(name, nd):
    """nn.Embedding(max_norm=...): the looked-up rows are renormed in the weight itself, which keeps
    its layout; a vocabulary split renorms each row where it lives, moving nothing."""
    w0 = torch.randn(11, 5) * 2
    ids = torch.tensor([[0, 10, 3, 3], [7, 5, 10, 2]])
    wr = w0.clone().requires_grad_(True)
    want = F.embedding(ids, wr, max_norm=1.0)
    want.pow(2).sum().backward()
    with gt.simulate(4):
        w = make_global(w0.clone(), PLACEMENTS[name](), nd, random.Random(0), requires_grad=True)
        with no_fallback():
            with gt.comm_stats() as st:
                with torch.no_grad():
                    torch.embedding_renorm_(w.detach(), ids, 1.0, 2.0)
            out = F.embedding(ids, w, max_norm=1.0)
            out.pow(2).sum().backward()
        if all(v in (S(0), B) for v in nd):
            assert st.bytes_sent == 0
        assert w.sbp == nd and w.grad.sbp == nd
        torch.testing.assert_close(w.full_tensor(), wr.detach())
        torch.testing.assert_close(out.full_tensor(), want)
        torch.testing.assert_close(w.grad.full_tensor(), wr.grad)
