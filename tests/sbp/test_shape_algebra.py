"""The balanced-split shape algebra, checked with hypothesis against numpy's array_split."""
import itertools

import numpy as np
from hypothesis import given, settings, strategies as st

from globaltensor.sbp import (balanced_range, balanced_sizes, broadcast, numel, partial_sum, piece_offset,
                              piece_ranges, piece_shape, split)

FAST = settings(max_examples=150, deadline=None)


@FAST
@given(st.integers(0, 100), st.integers(1, 17))
def test_balanced_sizes(n, k):
    sizes = balanced_sizes(n, k)
    assert len(sizes) == k
    assert sum(sizes) == n
    assert all(a >= b for a, b in zip(sizes, sizes[1:]))  # non-increasing
    assert max(sizes) - min(sizes) <= 1
    assert sizes == tuple(len(a) for a in np.array_split(np.arange(n), k))
    # the first n % k ranks get ceil(n/k), the rest floor(n/k)
    assert sizes == tuple(-(-n // k) if i < n % k else n // k for i in range(k))
    start = 0
    for i, s in enumerate(sizes):
        assert balanced_range(n, k, i) == (start, s)
        start += s


def test_balanced_examples():
    assert balanced_sizes(10, 4) == (3, 3, 2, 2)
    assert balanced_sizes(3, 5) == (1, 1, 1, 0, 0)
    assert balanced_sizes(0, 3) == (0, 0, 0)
    assert balanced_sizes(7, 1) == (7,)
    assert numel(()) == 1 and numel((3, 0, 2)) == 0 and numel((2, 3)) == 6


@st.composite
def layouts(draw, max_ndim=3, max_axes=3):
    ndim = draw(st.integers(0, max_ndim))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
    naxes = draw(st.integers(1, max_axes))
    hierarchy = tuple(draw(st.lists(st.integers(1, 4), min_size=naxes, max_size=naxes)))
    values = [broadcast, partial_sum] + [split(d) for d in range(ndim)]
    nd = tuple(draw(st.lists(st.sampled_from(values), min_size=naxes, max_size=naxes)))
    return shape, hierarchy, nd


def reference_piece(shape, hierarchy, nd, coord):
    """The element ids a coordinate holds, by numpy's array_split, axis after axis."""
    arr = np.arange(numel(shape)).reshape(shape)
    for axis, v in enumerate(nd):
        if v.is_split:
            arr = np.array_split(arr, hierarchy[axis], axis=v.dim)[coord[axis]]
    return arr


def slice_of(box):
    return tuple(slice(s, s + l) for s, l in box)


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_piece_ranges_match_array_split(layout):
    shape, hierarchy, nd = layout
    ids = np.arange(numel(shape)).reshape(shape)
    for coord in itertools.product(*map(range, hierarchy)):
        box = piece_ranges(shape, hierarchy, nd, coord)
        assert len(box) == len(shape)
        assert all(0 <= s and l >= 0 and s + l <= n for (s, l), n in zip(box, shape))
        ref = reference_piece(shape, hierarchy, nd, coord)
        assert np.array_equal(ids[slice_of(box)], ref)
        assert piece_shape(shape, hierarchy, nd, coord) == ref.shape
        assert piece_offset(shape, hierarchy, nd, coord) == tuple(s for s, _ in box)


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_split_axes_tile_the_tensor_exactly(layout):
    """Over the S axes (other axes fixed), the pieces are disjoint and cover the tensor; B and P axes
    replicate the same box."""
    shape, hierarchy, nd = layout
    s_axes = [a for a, v in enumerate(nd) if v.is_split]
    other = [a for a in range(len(hierarchy)) if a not in s_axes]
    for fixed in itertools.product(*(range(hierarchy[a]) for a in other)):
        cover = np.zeros(shape, dtype=np.int64)
        for moving in itertools.product(*(range(hierarchy[a]) for a in s_axes)):
            coord = [0] * len(hierarchy)
            for a, i in zip(other, fixed):
                coord[a] = i
            for a, i in zip(s_axes, moving):
                coord[a] = i
            box = piece_ranges(shape, hierarchy, nd, tuple(coord))
            cover[slice_of(box)] += 1
            # replicas along B / P axes hold the same box
            base = list(coord)
            for a in other:
                base[a] = 0
            assert box == piece_ranges(shape, hierarchy, nd, tuple(base))
        assert (cover == 1).all()


@settings(max_examples=200, deadline=None)
@given(layouts(max_axes=3))
def test_nested_splits_of_one_dim(layout):
    """Axes that split the same dim cut it one after the other: along each such axis the parts
    are contiguous and balanced within the part the earlier axes gave."""
    shape, hierarchy, nd = layout
    for a, v in enumerate(nd):
        if not v.is_split:
            continue
        d = v.dim
        for coord in itertools.product(*map(range, hierarchy)):
            if coord[a] != 0:
                continue
            row = [piece_ranges(shape, hierarchy, nd, coord[:a] + (i,) + coord[a + 1:]) for i in range(hierarchy[a])]
            # restricted to axes up to a, the parts along a tile the parent part in order
            prefix = [piece_ranges(shape, hierarchy[:a + 1], nd[:a + 1], coord[:a] + (i,)) for i in range(hierarchy[a])]
            parent = piece_ranges(shape, hierarchy[:a], nd[:a], coord[:a])
            lengths = [r[d][1] for r in prefix]
            assert tuple(lengths) == balanced_sizes(parent[d][1], hierarchy[a])
            starts = [r[d][0] for r in prefix]
            assert starts == [parent[d][0] + sum(lengths[:i]) for i in range(hierarchy[a])]
            # later axes only cut further inside
            for full, pre in zip(row, prefix):
                s, l = full[d]
                assert pre[d][0] <= s and s + l <= pre[d][0] + pre[d][1]


def test_two_axes_split_one_dim_examples():
    S0 = split(0)
    # 6 over 2x2 nested: halves of 3, then 2+1 each
    assert [piece_ranges((6,), (2, 2), (S0, S0), c)[0] for c in [(0, 0), (0, 1), (1, 0), (1, 1)]] == \
        [(0, 2), (2, 1), (3, 2), (5, 1)]
    # 3 over 2x2: dims smaller than the ranks leave empty pieces
    assert [piece_shape((3, 2), (2, 2), (S0, S0), c) for c in [(0, 0), (0, 1), (1, 0), (1, 1)]] == \
        [(1, 2), (1, 2), (1, 2), (0, 2)]
    # different dims: a grid
    assert piece_ranges((5, 3), (2, 3), (split(1), split(0)), (1, 2)) == ((4, 1), (2, 1))
    assert piece_ranges((0, 4), (3,), (S0,), (2,)) == ((0, 0), (0, 4))
    assert piece_ranges((), (4,), (partial_sum,), (3,)) == ()
