"""Placement: construction, meta, equality and hashing, and the errors bad input raises."""
import numpy as np
import pytest

import globaltensor as gt
from globaltensor.placement import Placement


@pytest.fixture(autouse=True)
def world8():
    with gt.simulate(8):
        yield


def test_from_list():
    p = gt.placement("cpu", ranks=[0, 1, 2, 3])
    assert p.type == "cpu"
    assert p.hierarchy == (4,)
    assert isinstance(p.ranks, np.ndarray)
    assert np.issubdtype(p.ranks.dtype, np.integer)
    assert p.ranks.tolist() == [0, 1, 2, 3]
    assert p.ndim == 1 and p.size == 4
    assert p.rank_list() == (0, 1, 2, 3)


def test_from_nested_list():
    p = gt.placement("cpu", ranks=[[0, 1], [2, 3]])
    assert p.hierarchy == (2, 2)
    assert p.ranks.shape == (2, 2)
    assert np.issubdtype(p.ranks.dtype, np.integer)
    assert p.ranks.tolist() == [[0, 1], [2, 3]]
    assert p.ndim == 2
    assert p.rank_list() == (0, 1, 2, 3)
    assert p.coord(2) == (1, 0)
    assert 3 in p and 5 not in p


def test_three_dims_and_unsorted_ranks():
    p = gt.placement("cpu", ranks=[[[7, 1]], [[0, 4]]])
    assert p.hierarchy == (2, 1, 2)
    assert p.rank_list() == (7, 1, 0, 4)
    assert p.coord(0) == (1, 0, 0)


def test_type_keyword_and_positional_and_cuda():
    assert gt.placement(type="cpu", ranks=[0]) == gt.placement("cpu", [0])
    assert gt.placement("cuda", [0, 1]).type == "cuda"


def test_other_rank_containers():
    ref = gt.placement("cpu", [0, 1, 2])
    assert gt.placement("cpu", (0, 1, 2)) == ref
    assert gt.placement("cpu", range(3)) == ref
    assert gt.placement("cpu", np.array([0, 1, 2], dtype=np.int32)) == ref
    assert gt.placement("cpu", [np.int64(0), np.int64(1), 2]) == ref


def test_ranks_are_read_only_and_copied():
    src = np.array([0, 1, 2])
    p = gt.placement("cpu", src)
    src[0] = 5
    assert p.ranks.tolist() == [0, 1, 2]
    with pytest.raises(ValueError):
        p.ranks[0] = 3


def test_equality_and_hashing():
    a = gt.placement("cpu", [0, 1, 2, 3])
    b = gt.placement("cpu", [0, 1, 2, 3])
    assert a == b and hash(a) == hash(b)
    assert a != gt.placement("cuda", [0, 1, 2, 3])
    assert a != gt.placement("cpu", [[0, 1], [2, 3]])  # same ranks, other hierarchy
    assert a != gt.placement("cpu", [1, 0, 2, 3])  # order matters
    assert a != gt.placement("cpu", [0, 1, 2])
    assert gt.placement("cpu", [[0, 1], [2, 3]]) != gt.placement("cpu", [[0, 2], [1, 3]])
    assert a != "cpu" and a != [0, 1, 2, 3]
    d = {a: 1, gt.placement("cpu", [[0, 1], [2, 3]]): 2}
    assert d[b] == 1
    assert d[gt.placement("cpu", [[0, 1], [2, 3]])] == 2
    assert len({a, b, gt.placement("cpu", [0, 1, 2, 3])}) == 1


def test_repr_names_type_and_ranks():
    r = repr(gt.placement("cpu", [[0, 1], [2, 3]]))
    assert "cpu" in r and "[[0, 1], [2, 3]]" in r


def test_all():
    with gt.simulate(4):
        p = gt.placement.all()
        assert p == gt.placement("cpu", [0, 1, 2, 3])
        assert gt.placement.all("cuda").type == "cuda"
    with gt.simulate(1):
        assert gt.placement.all().rank_list() == (0,)
    assert Placement.all().size == 8


# -- errors -------------------------------------------------------------------------------

def test_duplicate_ranks():
    with pytest.raises(ValueError, match=r"more than once"):
        gt.placement("cpu", [0, 1, 1])
    with pytest.raises(ValueError, match=r"rank\(s\) \[2\] appear more than once"):
        gt.placement("cpu", [[0, 2], [2, 3]])


def test_ranks_outside_the_world():
    with gt.simulate(4):
        with pytest.raises(ValueError, match=r"\[4\].*outside the world of 4 ranks"):
            gt.placement("cpu", [0, 4])
        with pytest.raises(ValueError, match=r"outside the world of 4"):
            gt.placement("cpu", [[0, 1], [2, 7]])
        gt.placement("cpu", [3])  # the last rank is fine
    with pytest.raises(ValueError, match=r"negative"):
        gt.placement("cpu", [0, -1])


def test_ranks_valid_after_resimulating():
    with gt.simulate(2):
        with pytest.raises(ValueError, match="outside the world"):
            gt.placement("cpu", [0, 1, 2])
    assert gt.placement("cpu", [0, 1, 2]).size == 3


@pytest.mark.parametrize("ranks", [[[0, 1], [2]], [[0], [1, 2]], [[0, 1], 2], [[0, 1], [2, [3]]],
                                   [[[0, 1]], [[2]]]])
def test_ragged_nesting(ranks):
    with pytest.raises(ValueError, match=r"ragged"):
        gt.placement("cpu", ranks)


@pytest.mark.parametrize("device", ["tpu", "CPU", "gpu", ""])
def test_unknown_device_type(device):
    with pytest.raises(ValueError, match=r"placement type.*'" + device + "'"):
        gt.placement(device, [0])


def test_non_string_device_type():
    with pytest.raises(TypeError, match=r"placement type"):
        gt.placement(0, [0])


@pytest.mark.parametrize("ranks", [[0.5, 1], [0, 1.0], ["0", "1"], [True, False], [None],
                                   np.array([0.0, 1.0]), np.array([True, False])])
def test_non_int_ranks(ranks):
    with pytest.raises(TypeError, match=r"expected ints"):
        gt.placement("cpu", ranks)


def test_missing_or_bare_int_ranks():
    with pytest.raises(TypeError, match=r"got None"):
        gt.placement("cpu")
    with pytest.raises(TypeError, match=r"got the int 3"):
        gt.placement("cpu", 3)


@pytest.mark.parametrize("ranks", [[], [[]], np.zeros((0,), dtype=np.int64)])
def test_empty_ranks(ranks):
    with pytest.raises(ValueError, match=r"at least one rank"):
        gt.placement("cpu", ranks)
