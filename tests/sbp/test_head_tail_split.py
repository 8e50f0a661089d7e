"""Head-tail splits (``split(d, order="head_tail")``): which indices each rank's piece holds, from the
definition -- each block of dim ``d`` cut into ``2W`` balanced chunks, rank ``r`` holding chunks ``r``
and ``2W - 1 - r`` in that order -- and the value itself (equality, hashing, text, pickling)."""
import pickle

import pytest
from hypothesis import given, strategies as st

from globaltensor.sbp import balanced_range, blocks_problem, nd_from_list, nd_to_list, piece_shape, split as S
from globaltensor.sbp import broadcast as B, partial_sum as P
from globaltensor.sbp.shape import segments


def _held(n: int, f: int, width: int, rank: int) -> list:
    """The indices of a dim of size ``n`` in ``f`` blocks that ``rank`` holds, by the definition."""
    size, out = n // f, []
    for block in range(f):
        for chunk in (rank, 2 * width - 1 - rank):
            start, length = balanced_range(size, 2 * width, chunk)
            out += [block * size + start + i for i in range(length)]
    return out


@given(m=st.integers(1, 40), f=st.sampled_from([1, 2, 3]), kind=st.sampled_from(["1d", "2x2", "3x2"]))
def test_segments_hold_the_defined_indices_and_tile_the_dim(m, f, kind):
    n = m * f
    hierarchy = {"1d": (4,), "2x2": (2, 2), "3x2": (3, 2)}[kind]
    nd = (S(1, blocks=f, order="head_tail"),) if kind == "1d" else (S(0), S(1, blocks=f, order="head_tail"))
    shape = (5, n)
    assert blocks_problem(shape, hierarchy, nd) is None
    width, axis = hierarchy[-1], len(hierarchy) - 1
    seen = []
    coords = [(c,) for c in range(4)] if kind == "1d" else [(a, b) for a in range(hierarchy[0]) for b in range(width)]
    for coord in coords:
        held = [i for start, length in segments(shape, hierarchy, nd, coord)[1] for i in range(start, start + length)]
        assert held == _held(n, f, width, coord[axis])
        assert piece_shape(shape, hierarchy, nd, coord)[1] == len(held)
        rows = (0, 5) if kind == "1d" else balanced_range(5, hierarchy[0], coord[0])
        assert segments(shape, hierarchy, nd, coord)[0] == (rows,)
        if kind == "1d" or coord[0] == 0:
            seen += held
    assert sorted(seen) == list(range(n))


@pytest.mark.parametrize("nd, problem", [
    ((S(1), S(1, order="head_tail")), "the only split of its dim"),
    ((S(1, order="head_tail"), S(1, order="head_tail")), "the only split of its dim"),
    ((S(0, order="head_tail"), S(1, blocks=2)), "a blocked split in plain order"),
    ((S(1, blocks=3, order="head_tail"), B), "does not hold 3 equal blocks"),
])
def test_layouts_a_head_tail_split_cannot_describe_are_named(nd, problem):
    assert problem in blocks_problem((4, 10), (2, 2), nd)


def test_the_value_compares_hashes_prints_and_round_trips():
    ht = S(1, order="head_tail")
    assert ht != S(1) and ht == S(1, order="head_tail") and hash(ht) == hash(S(1, 1, "head_tail"))
    assert ht.head_tail and not ht.blocked and S(1, blocks=2).blocked and not S(1, blocks=2).head_tail
    assert repr(ht) == "S(1, order='head_tail')"
    assert repr(S(0, blocks=2, order="head_tail")) == "S(0, blocks=2, order='head_tail')"
    assert pickle.loads(pickle.dumps(ht)) == ht
    nd = (S(0, blocks=2, order="head_tail"), B, P, S(1))
    assert nd_from_list(nd_to_list(nd)) == nd
    assert nd_to_list((ht,)) == [["S", 1, 1, "head_tail"]]
    with pytest.raises(ValueError, match="expected order to be one of"):
        S(1, order="zigzag")
