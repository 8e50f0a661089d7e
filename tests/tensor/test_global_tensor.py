"""The GlobalTensor contract of DESIGN.md §1 on simulated worlds."""
import numpy as np
import pytest
import torch

import globaltensor as gt
from globaltensor.sbp import B, P, S



def test_local_tensor_is_each_ranks_piece(p1):
    t = torch.arange(6.0).reshape(2, 3)
    s = t.to_global(placement=p1, sbp=S(0))
    assert s.shape == (8, 3) and s.sbp == (S(0),) and s.is_global and not t.is_global
    assert torch.equal(s.full_tensor(), torch.cat([t] * 4))
    b = gt.to_global(t, p1, B)
    assert b.shape == (2, 3) and torch.equal(b.full_tensor(), t)
    p = t.to_global(p1, P)
    assert torch.equal(p.full_tensor(), 4 * t)
    assert torch.equal(s.to_local(rank=2), t)
    assert set(s.local_tensors()) == {0, 1, 2, 3}


def test_distribute_keeps_each_ranks_slice(p1, p2):
    t = torch.randn(7, 5)
    x = gt.distribute(t, p1, S(1))
    assert [tuple(v.shape) for v in x.local_tensors().values()] == [(7, 2), (7, 1), (7, 1), (7, 1)]
    assert torch.equal(x.full_tensor(), t)
    y = gt.distribute(t, p2, (S(0), S(0)))
    assert [y.to_local(rank=r).shape[0] for r in range(4)] == [2, 2, 2, 1]
    assert np.array_equal(y.numpy(), t.numpy())
    z = gt.distribute(t, p2, (P, S(1)))
    assert torch.allclose(z.full_tensor(), t)


def test_repr_names_shape_placement_and_sbp(p2):
    x = gt.zeros(4, 6, placement=p2, sbp=(S(0), B))
    text = repr(x)
    assert "(4, 6)" in text and "[[0, 1], [2, 3]]" in text and "(S(0), B)" in text


def test_to_global_changes_placement_and_nd_sbp(p1, p2):
    t = torch.randn(6, 4)
    x = gt.distribute(t, p1, S(0))
    m = x.to_global(placement=p2, sbp=(S(0), B))
    assert m.placement == p2 and m.sbp == (S(0), B)
    assert torch.equal(m.full_tensor(), t)
    with pytest.raises(ValueError, match="sbp is required"):
        x.to_global(placement=p2)


def test_to_global_is_differentiable_with_transposed_boxing(p1):
    t, wt = torch.randn(8, 3), torch.randn(3, 4)
    x = gt.distribute(t, p1, S(0)).requires_grad_(True)
    y = x.to_global(sbp=B)
    assert torch.equal((y * y).sum().full_tensor(), (t * t).sum())
    w = gt.distribute(wt, p1, S(1))
    z = y @ w
    assert z.sbp == (S(1),)
    with gt.comm_stats() as st:
        z.backward(gt.distribute(torch.ones(8, 4), p1, S(1)))
    assert st.ops() == ["reduce_scatter"], "the gradient of an all-gather is a reduce-scatter"
    assert x.grad.sbp == (S(0),)
    assert torch.allclose(x.grad.full_tensor(), torch.ones(8, 4) @ wt.T)


def test_grad_sbp_chooses_the_gradient_layout(p1):
    t = torch.randn(8, 3)
    x = gt.distribute(t, p1, B).requires_grad_(True)
    y = x.to_global(sbp=S(1), grad_sbp=S(0))
    g, = torch.autograd.grad(y.sum(), x)
    assert g.sbp == (S(0),)
    assert torch.equal(g.full_tensor(), torch.ones(8, 3))


def test_partial_leaf_gradient_reads_as_broadcast(p1):
    x = gt.distribute(torch.randn(4, 4), p1, P).requires_grad_(True)
    (x * 3).sum().backward()
    assert x.grad.sbp == (B,)
    assert torch.equal(x.grad.full_tensor(), torch.full((4, 4), 3.0))


def test_from_local_backward_gives_each_rank_its_piece(p1):
    t = torch.randn(2, 3, requires_grad=True)
    x = t.to_global(p1, S(0))
    (x * 2).sum().backward()
    assert torch.equal(t.grad, torch.full((2, 3), 2.0))


def test_ranks_outside_the_placement_hold_empty_pieces(world4):
    sub = gt.placement("cpu", [1, 3])
    x = gt.distribute(torch.arange(6.0), sub, S(0))
    assert set(x.local_tensors()) == {1, 3}
    assert x.to_local(rank=0).numel() == 0
    assert torch.equal((x * 2).full_tensor(), torch.arange(6.0) * 2)


def test_factories_take_dtype_and_requires_grad(p2):
    z = gt.zeros(3, 5, placement=p2, sbp=(S(1), S(0)), dtype=torch.float64, requires_grad=True)
    assert z.dtype == torch.float64 and z.requires_grad and z.is_leaf
    o = gt.ones(2, 2, placement=p2, sbp=(P, B))
    assert torch.equal(o.full_tensor(), torch.ones(2, 2))
    f = gt.full((3,), 7, placement=p2, sbp=(B, S(0)))
    assert f.dtype == torch.int64 and torch.equal(f.full_tensor(), torch.full((3,), 7))
    a = gt.arange(2, 11, 3, placement=p2, sbp=(S(0), S(0)))
    assert torch.equal(a.full_tensor(), torch.arange(2, 11, 3))
    e = gt.empty(4, 1, placement=p2, sbp=(S(0), B))
    assert e.shape == (4, 1)


@pytest.mark.parametrize("n", [1, 3, 4])
def test_random_factories_are_sharding_invariant(n):
    gt.manual_seed(1234)
    with gt.simulate(1):
        ref_n = gt.randn(5, 7, placement=gt.placement("cpu", [0]), sbp=B).full_tensor()
        ref_u = gt.rand(5, 7, placement=gt.placement("cpu", [0]), sbp=B).full_tensor()
    gt.manual_seed(1234)
    with gt.simulate(n):
        p = gt.placement("cpu", list(range(n))[::-1])
        x = gt.randn(5, 7, placement=p, sbp=S(1))
        u = gt.rand(5, 7, placement=p, sbp=P)
        assert torch.equal(x.full_tensor(), ref_n)
        assert torch.allclose(u.full_tensor(), ref_u)
    assert not torch.equal(ref_n, gt.randn(5, 7, placement=gt.placement("cpu", [0]), sbp=B).full_tensor())


def test_random_values_have_the_right_distribution():
    gt.manual_seed(7)
    with gt.simulate(2):
        p = gt.placement("cpu", [0, 1])
        x = gt.randn(200, 500, placement=p, sbp=S(0)).full_tensor()
        u = gt.rand(200, 500, placement=p, sbp=S(1), dtype=torch.float64).full_tensor()
    assert abs(x.mean().item()) < 0.01 and abs(x.std().item() - 1) < 0.01
    assert 0 <= u.min().item() and u.max().item() < 1 and abs(u.mean().item() - 0.5) < 0.01
    assert u.dtype == torch.float64


def test_bad_input_names_the_argument(p1, p2):
    t = torch.randn(4, 4)
    with pytest.raises(ValueError, match="split dim 2 is out of range"):
        gt.distribute(t, p1, S(2))
    with pytest.raises(ValueError, match="expected 2 SBP"):
        gt.distribute(t, p2, S(0))
    with pytest.raises(TypeError, match="expected SBP values"):
        gt.distribute(t, p1, ("S0",))
    with pytest.raises(ValueError, match="one placement"):
        gt.distribute(t, p1, S(0)) + gt.distribute(t, p2, (S(0), B))
    with pytest.raises(TypeError, match="placement"):
        gt.randn(2, 2, placement="cpu", sbp=B)
    with pytest.raises(ValueError, match="sbp= is required"):
        gt.zeros(2, placement=p1)
    with pytest.raises(TypeError, match="floating"):
        gt.randn(2, placement=p1, sbp=B, dtype=torch.int64)
    with pytest.raises(ValueError, match="does not live in this process"):
        gt.distribute(t, p1, B).to_local(rank=9)
    with pytest.raises(ValueError, match="needs both placement"):
        t.to_global(sbp=B)
    with pytest.raises(ValueError, match="expected"):
        gt.to_global(t, p1, S(0), shape=(9, 4))


def test_simulate_is_a_function_and_a_context_manager():
    outer = gt.get_world()
    with gt.simulate(3) as w:
        assert gt.world_size() == 3 and w is gt.get_world() and gt.rank() == 0
    assert gt.get_world() is outer
    with pytest.raises(ValueError, match="positive number of ranks"):
        gt.simulate(0)


@pytest.mark.parametrize("sbp", [B, S(0), S(1), P])
def test_distribute_owns_its_memory(sbp):
    """Writing into a distributed tensor leaves the source tensor alone, for every layout."""
    t = torch.randn(6, 4)
    before = t.clone()
    with gt.simulate(4):
        x = gt.distribute(t, gt.placement("cpu", [0, 1, 2, 3]), sbp)
        with torch.no_grad():
            x.add_(1)
        torch.testing.assert_close(t, before)
        torch.testing.assert_close(x.full_tensor(), before + 1)


@pytest.mark.parametrize("sbp", [B, S(0), P])
def test_distribute_gives_a_leaf_and_to_global_stays_differentiable(p1, sbp):
    """As DTensor's ``distribute_tensor``: a leaf with the source's ``requires_grad``, whose ``.grad``
    fills (in its own layout); ``to_global`` of the same tensor passes the gradient to the source."""
    t = torch.randn(8, 3, dtype=torch.float64, requires_grad=True)
    x = gt.distribute(t, p1, sbp)
    assert x.is_leaf and x.requires_grad
    assert not gt.distribute(t.detach(), p1, sbp).requires_grad
    (x * 2).sum().backward()
    assert t.grad is None and x.grad.sbp == tuple(B if v.is_partial else v for v in x.sbp)
    torch.testing.assert_close(x.grad.full_tensor(), torch.full((8, 3), 2.0, dtype=torch.float64))
    y = t.to_global(p1, sbp)
    assert not y.is_leaf
    (y * 3).sum().backward()
    torch.testing.assert_close(t.grad, torch.full((8, 3), 3.0, dtype=torch.float64))
