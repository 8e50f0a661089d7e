"""What the DTensor bridge refuses, on simulated ranks (the conversions run on processes:
tests/multiprocess/test_dtensor.py)."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import globaltensor as gt
from globaltensor.interop.dtensor import dtensor_placements, sbp_of_placements

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum


def test_sbp_and_dtensor_placements_map_axis_for_axis():
    nd = (S(1), B, P)
    assert dtensor_placements(nd) == (Shard(1), Replicate(), Partial("sum"))
    assert sbp_of_placements(dtensor_placements(nd)) == nd


@pytest.mark.parametrize("placement", [Partial("avg"), Partial("max"), _StridedShard(0, split_factor=2)])
def test_placements_without_an_sbp_are_named(placement):
    with pytest.raises(ValueError, match=r"from_dtensor: DTensor placement .* has no SBP equal"):
        sbp_of_placements([Replicate(), placement])


def test_a_simulated_world_cannot_hold_a_dtensor(p1):
    x = gt.zeros(4, 2, placement=p1, sbp=S(0))
    with pytest.raises(RuntimeError, match="to_dtensor: DTensor keeps one rank's piece per process"):
        x.to_dtensor()
    with pytest.raises(TypeError, match="to_dtensor: expected a global tensor, got Tensor"):
        gt.to_dtensor(torch.zeros(2))
    with pytest.raises(TypeError, match="from_dtensor: expected a torch.distributed.tensor.DTensor, got GlobalTensor"):
        gt.from_dtensor(x)
