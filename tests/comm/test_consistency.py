"""The consistency check (gt.set_check) on simulated ranks: silent on consistent programs (same results
as with it off), raising gt.ConsistencyError on every inconsistency it is built to see."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import globaltensor as gt
from globaltensor.observe.consistency import CHECK

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum


@pytest.fixture
def check_on():
    previous = gt.set_check(True)
    yield
    gt.set_check(previous)


def _training_losses(p2) -> list:
    """Two SGD steps of a Megatron-style MLP on a 2x2 placement; the losses (float64)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    gt.nn.distribute_module(model, p2, {"0.weight": (B, S(0)), "0.bias": (B, S(0)), "2.weight": (B, S(1)),
                                        "*": (B, B)})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = gt.distribute(torch.randn(8, 6, dtype=torch.float64), p2, (S(0), B))
    y = gt.distribute(torch.randn(8, 3, dtype=torch.float64), p2, (S(0), B))
    losses = []
    for _ in range(2):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_a_consistent_training_step_passes_the_check_unchanged(p2):
    assert not CHECK.enabled
    off = _training_losses(p2)
    gt.set_check(True)
    try:
        on = _training_losses(p2)
    finally:
        gt.set_check(False)
    assert on == off          # exact: the check reads, never writes


def test_set_check_returns_the_previous_state():
    assert gt.set_check(True) is False
    assert gt.set_check(False) is True


def test_a_replica_changed_on_one_rank_is_named(p1, check_on):
    x = gt.distribute(torch.arange(8.0).reshape(4, 2), p1, B)
    x.to_local(rank=3).mul_(2)
    with pytest.raises(gt.ConsistencyError, match=r"before op aten.sum.default: ranks \[3\] disagree with rank 0: "
                                                  r"argument self: the pieces of ranks \[0, 1, 2\] and \[3\] differ"):
        x.sum()


def test_replicas_along_one_axis_of_a_2d_placement(p2, check_on):
    """(S(0), B): ranks 0 and 1 hold one block, ranks 2 and 3 another; only rank 1's copy differs."""
    x = gt.distribute(torch.arange(16.0).reshape(4, 4), p2, (S(0), B))
    (x * 1).to_global(sbp=(B, B))                   # consistent: fine
    x.to_local(rank=1).add_(1)
    with pytest.raises(gt.ConsistencyError, match=r"ranks \[1\] disagree .* pieces of ranks \[0\] and \[1\] differ"):
        x + 1


def test_split_pieces_differing_are_not_an_inconsistency(p1, check_on):
    x = gt.distribute(torch.arange(8.0).reshape(4, 2), p1, S(0))
    x.to_local(rank=2).add_(100)                    # a split piece is its rank's own: nothing to compare
    x + 1


def test_partial_pieces_differing_are_not_an_inconsistency(p1, check_on):
    x = gt.distribute(torch.arange(8.0).reshape(4, 2), p1, B).to_global(sbp=P)
    x.to_global(sbp=B)


def test_a_piece_of_the_wrong_shape_is_named(p1, check_on):
    x = gt.distribute(torch.arange(12.0).reshape(6, 2), p1, S(0))     # pieces of 2, 2, 1, 1 rows
    x._pieces[3] = torch.zeros(2, 2)
    with pytest.raises(gt.ConsistencyError, match=r"ranks \[3\] disagree with rank 0: argument self: rank 3's "
                                                  r"piece has shape \(2, 2\) .* gives it \(1, 2\)"):
        torch.relu(x)


def test_the_check_is_off_by_default_and_costs_no_exchange(p1):
    assert not CHECK.enabled
    x = gt.distribute(torch.arange(8.0).reshape(4, 2), p1, B)
    x.to_local(rank=3).mul_(2)
    x.sum()                                         # unchecked: no error (the user's mistake goes unseen)


def test_a_buffer_an_op_only_fills_is_not_compared(p1, check_on):
    """``bernoulli_`` writes into an uninitialised replica: its old values may differ between ranks."""
    x = gt.empty(4, 4, placement=p1, sbp=B)
    for r, piece in x.local_tensors().items():
        piece.fill_(float(r))                       # as uninitialised memory may be
    x.bernoulli_(0.5)
    torch.nn.functional.dropout(gt.ones(8, 4, placement=p1, sbp=B), 0.3)
