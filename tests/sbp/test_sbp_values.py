"""SBP values and nd-SBP validation."""
import copy
import dataclasses
import pickle

import pytest

import globaltensor as gt
from globaltensor.sbp import (B, Broadcast, P, PartialSum, S, SbpValue, Split, as_nd_sbp, broadcast,
                              normalize_split, partial_sum, split, split_axes)


def test_kinds():
    assert split(1).is_split and not split(1).is_broadcast and not split(1).is_partial
    assert broadcast.is_broadcast and not broadcast.is_split and not broadcast.is_partial
    assert partial_sum.is_partial and not partial_sum.is_split and not partial_sum.is_broadcast
    assert split(2).dim == 2 and split().dim == 0
    for v in (split(0), broadcast, partial_sum):
        assert isinstance(v, SbpValue)
    assert gt.sbp.S is split and gt.sbp.B is broadcast and gt.sbp.P is partial_sum
    assert S is split and B is broadcast and P is partial_sum


def test_equality_and_hashing():
    assert split(0) == split(0) == Split(0)
    assert split(0) != split(1)
    assert split(-1) != split(1)  # normalised only against a tensor
    assert broadcast == Broadcast() and partial_sum == PartialSum()
    assert broadcast != partial_sum and split(0) != broadcast and split(0) != partial_sum
    assert hash(split(3)) == hash(Split(3))
    assert hash(Broadcast()) == hash(broadcast)
    assert len({split(0), split(0), split(1), broadcast, Broadcast(), partial_sum, PartialSum()}) == 4
    assert {(split(0), broadcast): 1}[(Split(0), Broadcast())] == 1
    assert split(0) != 0 and broadcast != "B"


@pytest.mark.parametrize("v", [split(0), broadcast, partial_sum])
def test_immutable(v):
    with pytest.raises((AttributeError, dataclasses.FrozenInstanceError)):
        v.dim = 5
    with pytest.raises((AttributeError, dataclasses.FrozenInstanceError)):
        v.is_split = True
    with pytest.raises((AttributeError, dataclasses.FrozenInstanceError, TypeError)):
        v.anything = 1


def test_copies_and_pickles_equal():
    for v in (split(2), broadcast, partial_sum):
        assert copy.deepcopy(v) == v
        assert pickle.loads(pickle.dumps(v)) == v


def test_repr():
    assert repr(split(0)) == "S(0)"
    assert repr(split(-1)) == "S(-1)"
    assert repr(broadcast) == "B"
    assert repr(partial_sum) == "P"
    assert repr((split(1), broadcast)) == "(S(1), B)"


@pytest.mark.parametrize("dim", [1.0, "0", None, True, [0]])
def test_split_dim_must_be_int(dim):
    with pytest.raises(TypeError, match=r"split\(dim\).*int"):
        split(dim)


# -- as_nd_sbp ----------------------------------------------------------------------------

def test_bare_value_for_1d():
    assert as_nd_sbp(split(0), 1) == (split(0),)
    assert as_nd_sbp(broadcast, 1) == (broadcast,)
    assert as_nd_sbp([split(0), partial_sum], 2) == (split(0), partial_sum)
    assert as_nd_sbp((broadcast, broadcast, split(1)), 3, 2) == (broadcast, broadcast, split(1))


@pytest.mark.parametrize("sbp,n", [(split(0), 2), ((broadcast,), 2), ((broadcast, broadcast), 1),
                                   ((), 1), ((broadcast,) * 3, 2)])
def test_length_must_match_placement_dims(sbp, n):
    with pytest.raises(ValueError, match=rf"x: expected {n} SBP value\(s\).*got {len(as_tuple(sbp))}"):
        as_nd_sbp(sbp, n, name="x")


def as_tuple(sbp):
    return sbp if isinstance(sbp, tuple) else (sbp,)


@pytest.mark.parametrize("ndim,d,expected", [(1, 0, 0), (1, -1, 0), (2, -1, 1), (2, -2, 0), (3, -2, 1),
                                             (3, 2, 2)])
def test_negative_split_dims_are_normalised(ndim, d, expected):
    assert as_nd_sbp(split(d), 1, ndim) == (split(expected),)
    assert normalize_split(split(d), ndim) == split(expected)
    assert as_nd_sbp((broadcast, split(d)), 2, ndim) == (broadcast, split(expected))


def test_no_normalisation_without_tensor_ndim():
    assert as_nd_sbp(split(-1), 1) == (split(-1),)


@pytest.mark.parametrize("ndim,d", [(1, 1), (1, -2), (2, 2), (2, -3), (3, 7)])
def test_split_dim_out_of_range(ndim, d):
    with pytest.raises(ValueError, match=rf"t\.sbp: split dim {d} is out of range for a tensor of {ndim} dims"):
        as_nd_sbp((broadcast, split(d)), 2, ndim, name="t.sbp")


def test_split_of_0_dim_tensor():
    with pytest.raises(ValueError, match=r"split\(0\) is impossible for a 0-dim tensor"):
        as_nd_sbp(split(0), 1, 0)
    assert as_nd_sbp(partial_sum, 1, 0) == (partial_sum,)


@pytest.mark.parametrize("sbp", ["S(0)", 0, None, "B", {broadcast}, iter([broadcast])])
def test_not_an_sbp_is_a_type_error(sbp):
    with pytest.raises(TypeError, match=r"y: expected an SBP"):
        as_nd_sbp(sbp, 1, name="y")


@pytest.mark.parametrize("sbp", [(broadcast, "S(0)"), [0], (split(0), None)])
def test_non_sbp_entry_is_a_type_error(sbp):
    with pytest.raises(TypeError, match=r"z: expected SBP values.*got"):
        as_nd_sbp(sbp, len(sbp), name="z")


def test_split_axes():
    nd = (split(0), broadcast, split(1), split(0), partial_sum)
    assert split_axes(nd, 0) == [0, 3]
    assert split_axes(nd, 1) == [2]
    assert split_axes(nd, 2) == []


def test_numpy_int_dim_is_accepted():
    np = pytest.importorskip("numpy")
    v = split(np.int64(1))
    assert v == split(1) and type(v.dim) is int and hash(v) == hash(split(1))
