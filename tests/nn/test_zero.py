"""gt.nn.ZeroOptimizer: optimizer state and update sharded over the data axis, same training."""
from __future__ import annotations

import copy

import pytest
import torch

import globaltensor as gt
import globaltensor.nn as gnn
from globaltensor.tensor import GlobalTensor
from nn_models import MEGATRON_2D, net, train_side_by_side

S, B = gt.sbp.split, gt.sbp.broadcast



def test_shard_sbp(p1, p2):
    def layout(shape, placement, sbp):
        return gt.zeros(*shape, placement=placement, sbp=sbp)
    assert gnn.shard_sbp(layout((10, 6), p1, B), 0) == (S(0),)
    assert gnn.shard_sbp(layout((3, 8), p1, B), 0) == (S(1),), "the largest dim"
    assert gnn.shard_sbp(layout((5,), p1, B), 0) == (S(0),)
    assert gnn.shard_sbp(layout((), p1, B), 0) == (B,), "0-dim tensors are not split"
    assert gnn.shard_sbp(layout((10, 6), p1, S(1)), 0) == (S(1),), "already split on the axis"
    assert gnn.shard_sbp(layout((10, 6), p2, (B, S(0))), 0) == (S(1), S(0)), "a dim the tensor axis leaves"
    assert gnn.shard_sbp(layout((10,), p2, (B, S(0))), 0) == (S(0), S(0)), "no free dim: split it further"
    assert gnn.shard_sbp(layout((10, 6), p2, (B, B)), 1) == (B, S(0))


def _train(placement, plan, batch_sbp, cls, kw, steps=3, zero_axis=0):
    """Train a distributed and a single-device net side by side; the distributed one with
    ZeroOptimizer over ``zero_axis``. Returns (model, reference, optimizer)."""
    ref, m = net(), net()
    gnn.distribute_module(m, placement, plan)
    opt_ref = cls(ref.parameters(), **kw)
    opt = gnn.ZeroOptimizer(m.parameters(), cls, axis=zero_axis, **kw)
    train_side_by_side(ref, m, opt_ref, opt, placement, batch_sbp, steps)
    for (name, prm), want in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(prm.full_tensor(), want, rtol=1e-4, atol=1e-5, msg=name)
    return m, ref, opt


def _state_is_sharded(m, opt, axis):
    """Every tensor state of every parameter is split over ``axis`` like its shard: per data-axis
    group, the pieces together hold the parameter once (1/n of it per rank)."""
    placement = next(m.parameters()).placement
    n = placement.hierarchy[axis]
    checked = 0
    for name, prm in m.named_parameters():
        shard = opt.shard_of(prm)
        assert shard is not None and shard.sbp == gnn.shard_sbp(prm, axis), name
        assert shard.sbp[axis].is_split, name
        assert prm.sbp[axis] == B, f"{name}: the parameter stays replicated on the data axis"
        for key, value in opt.state[shard].items():
            if not isinstance(value, GlobalTensor) or value.dim() == 0:
                continue
            assert value.sbp == shard.sbp, (name, key)
            held = sum(t.numel() for t in value.local_tensors().values())
            assert held * n == sum(t.numel() for t in prm.local_tensors().values()), (name, key)
            checked += 1
    assert checked >= len(list(m.parameters()))


@pytest.mark.parametrize("cls,kw", [
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    (torch.optim.AdamW, dict(lr=0.01, eps=1e-6, weight_decay=0.1)),
    (torch.optim.Adam, dict(lr=0.01, eps=1e-6, foreach=True)),
], ids=["sgd-momentum", "adamw", "adam-foreach"])
def test_zero_data_parallel_matches_single_device(p1, cls, kw):
    m, _, opt = _train(p1, {}, S(0), cls, kw)
    _state_is_sharded(m, opt, 0)


def test_zero_on_the_data_axis_of_a_hybrid_placement(p2):
    m, _, opt = _train(p2, MEGATRON_2D, (S(0), B), torch.optim.AdamW, dict(lr=0.01, eps=1e-6))
    _state_is_sharded(m, opt, 0)
    up = opt.shard_of(m.blocks[0].up.weight)                     # [10, 6], tensor axis S(0)
    assert up.sbp == (S(1), S(0))
    assert [tuple(t.shape) for t in opt.state[up]["exp_avg"].local_tensors().values()] == [(5, 3)] * 4


def test_step_reduce_scatters_and_all_gathers_instead_of_all_reducing(p1):
    """The ZeRO step moves no more bytes than data parallelism's gradient all-reduce, without any all-reduce."""
    def one_step(zero):
        m = net()
        gnn.distribute_module(m, p1, {})
        loss = m(gt.distribute(torch.randn(8, 6), p1, S(0))).square().mean()
        loss.backward()
        if zero:
            opt = gnn.ZeroOptimizer(m.parameters(), torch.optim.SGD, lr=0.1)
            with gt.comm_stats() as st:
                opt.step()
        else:
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            with gt.comm_stats() as st:
                opt.step()
        return st
    dp, zero = one_step(False), one_step(True)
    assert set(dp.ops()) == {"all_reduce"}
    assert "all_reduce" not in zero.ops() and "all_gather" in zero.ops()
    assert zero.bytes_sent <= dp.bytes_sent * 1.1, (zero.bytes_sent, dp.bytes_sent)


def test_zero_grad_state_dict_closure_and_errors(p1):
    m = net()
    gnn.distribute_module(m, p1, {})
    opt = gnn.ZeroOptimizer([{"params": list(m.blocks.parameters())}, {"params": [m.head.weight], "lr": 0.5}],
                            torch.optim.SGD, lr=0.1, momentum=0.9)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.5]
    x = gt.distribute(torch.randn(8, 6), p1, S(0))

    def closure():
        opt.zero_grad()
        loss = m(x).square().mean()
        loss.backward()
        return loss
    loss = opt.step(closure)
    assert isinstance(loss, GlobalTensor) and m.head.weight.grad is not None
    assert m.head.weight.grad.sbp == m.head.weight.sbp
    opt.zero_grad(set_to_none=False)
    assert m.head.weight.grad.full_tensor().abs().sum() == 0
    opt.zero_grad()
    assert all(p.grad is None for p in m.parameters())

    saved = copy.deepcopy(opt.state_dict())
    saved_momentum = {k: v["momentum_buffer"].full_tensor().clone() for k, v in saved["state"].items()}
    opt.step(closure)
    moved = opt.state_dict()["state"][0]["momentum_buffer"].full_tensor()
    assert not torch.allclose(moved, saved_momentum[0]), "the step changed the state"
    opt.load_state_dict(saved)
    for k, v in opt.state_dict()["state"].items():
        torch.testing.assert_close(v["momentum_buffer"].full_tensor(), saved_momentum[k])

    with pytest.raises(TypeError, match="global parameters"):
        gnn.ZeroOptimizer(net().parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="axis"):
        gnn.ZeroOptimizer(m.parameters(), torch.optim.SGD, axis=1, lr=0.1)
    with pytest.raises(ValueError, match="partial_sum"):
        gnn.ZeroOptimizer([gt.zeros(4, placement=p1, sbp=gt.sbp.partial_sum, requires_grad=True)],
                          torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="optimizer_class"):
        gnn.ZeroOptimizer(m.parameters(), "sgd", lr=0.1)
    with pytest.raises(ValueError, match="empty"):
        gnn.ZeroOptimizer([], torch.optim.SGD, lr=0.1)
