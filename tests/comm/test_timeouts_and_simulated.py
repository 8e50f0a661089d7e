"""gt.set_timeout and GT_COLLECTIVE_TIMEOUT; a simulated collective that some ranks did not join."""
from __future__ import annotations

import pytest
import torch

import globaltensor as gt
from globaltensor.comm import timeouts


@pytest.fixture
def fresh_timeout(monkeypatch):
    """The timeout as a new process would read it, restored afterwards."""
    monkeypatch.setattr(timeouts, "_seconds", None)
    monkeypatch.delenv("GT_COLLECTIVE_TIMEOUT", raising=False)


def test_default_timeout_is_60_s(fresh_timeout):
    assert timeouts.timeout_s() == 60.0


def test_environment_sets_the_timeout(fresh_timeout, monkeypatch):
    monkeypatch.setenv("GT_COLLECTIVE_TIMEOUT", "7.5")
    assert timeouts.timeout_s() == 7.5


def test_set_timeout_returns_the_previous_one(fresh_timeout):
    assert gt.set_timeout(5) == 60.0
    assert gt.set_timeout(12.5) == 5.0
    assert timeouts.collective_timeout().total_seconds() == 12.5


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), "10", True, None])
def test_set_timeout_rejects_what_is_not_a_positive_number_of_seconds(fresh_timeout, bad):
    with pytest.raises(ValueError, match=r"set_timeout\(seconds\): expected a positive finite number of seconds"):
        gt.set_timeout(bad)
    assert timeouts.timeout_s() == 60.0


def test_simulated_collective_missing_ranks_names_them(world4):
    p = gt.placement("cpu", [0, 1, 2, 3])
    x = gt.distribute(torch.arange(8.0), p, gt.sbp.split(0))
    with pytest.raises(gt.CollectiveError, match=r"all_gather over ranks \[0, 1, 2, 3\]: ranks \[1, 3\] did not arrive"):
        world4.all_gather((0, 1, 2, 3), {0: x.to_local(rank=0), 2: x.to_local(rank=2)}, 0, [2, 2, 2, 2], (8,),
                          torch.float32)


def test_collective_method_names_itself_when_ranks_are_missing(world4):
    """A tensor of 4 simulated ranks read in a world of 2: ranks 2 and 3 bring no piece."""
    x = gt.randn(8, 4, placement=gt.placement("cpu", [0, 1, 2, 3]), sbp=gt.sbp.split(0))
    with gt.simulate(2):
        with pytest.raises(gt.CollectiveError, match=r"ranks \[2, 3\] did not arrive.*numpy\(\) is a collective: "
                                                     r"every rank of the placement \[0, 1, 2, 3\] must call it"):
            x.numpy()
