"""Blocked splits (``split(d, blocks=f)``): which elements each rank's piece holds, from the
definition -- dim ``d`` is ``f`` equal blocks side by side; plain splits of ``d`` on earlier axes
cut whole blocks, the blocked axis cuts each block balanced, a piece is its parts in block order."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import globaltensor as gt
from globaltensor.sbp import balanced_range, blocks_problem, piece_shape, split as S, broadcast as B

HIERARCHIES = {"1d": (4,), "2x2": (2, 2)}


def reference_indices(n: int, f: int, outer_cut: tuple, inner_cut: tuple) -> list:
    """Indices of a dim of size ``n`` in ``f`` blocks held by a rank whose plain axes give it the
    ``outer_cut`` = (part, parts) of the blocks and whose blocked axis gives it ``inner_cut``."""
    m = n // f
    o0, olen = balanced_range(f, outer_cut[1], outer_cut[0])
    i0, ilen = balanced_range(m, inner_cut[1], inner_cut[0])
    return [o * m + i for o in range(o0, o0 + olen) for i in range(i0, i0 + ilen)]


@settings(max_examples=40, deadline=None)
@given(f=st.integers(1, 4), m=st.integers(0, 6), rows=st.integers(1, 3), kind=st.sampled_from(["1d", "2x2"]),
       plain_first=st.booleans())
def test_pieces_hold_their_part_of_every_block(f, m, rows, kind, plain_first):
    hierarchy = HIERARCHIES[kind]
    if kind == "2x2" and plain_first and f % 2:
        f *= 2                                     # the plain axis cuts whole blocks
    n = f * m
    x = torch.arange(rows * n, dtype=torch.float64).reshape(rows, n)
    nd = (S(1, blocks=f),) if kind == "1d" else ((S(1), S(1, blocks=f)) if plain_first else (B, S(1, blocks=f)))
    with gt.simulate(4):
        ranks = [0, 1, 2, 3] if kind == "1d" else [[0, 1], [2, 3]]
        g = gt.distribute(x, gt.placement("cpu", ranks), nd if kind == "2x2" else nd[0])
        for r, piece in g._pieces.items():
            coord = g.placement.coord(r)
            outer = (coord[0], 2) if kind == "2x2" and plain_first else (0, 1)
            inner = (coord[-1], hierarchy[-1])
            want = x[:, reference_indices(n, f, outer, inner)]
            assert torch.equal(piece, want), (r, nd)
            assert tuple(piece.shape) == piece_shape((rows, n), hierarchy, nd, coord)
        assert torch.equal(g.full_tensor(), x)


@pytest.mark.parametrize("nd,problem", [
    ((S(1, blocks=3),), "does not hold 3 equal blocks"),
    ((S(1, blocks=2), S(1)), "comes after its blocked split"),
    ((S(1), S(1, blocks=3)), "cut its 3 blocks over 2 ranks"),
    ((S(1, blocks=2), S(1, blocks=3)), "different block counts"),
])
def test_layouts_that_blocks_cannot_describe_are_named(nd, problem):
    shape = (4, 10) if nd == (S(1, blocks=3),) else (4, 12)
    assert problem in blocks_problem(shape, (2,) * len(nd), nd)


def test_plain_splits_are_unchanged_and_blocks_one_is_plain():
    assert S(0, blocks=1) == S(0) and hash(S(0, blocks=1)) == hash(S(0)) and repr(S(0)) == "S(0)"
    assert S(0, blocks=3) != S(0) and repr(S(1, blocks=3)) == "S(1, blocks=3)"
    assert blocks_problem((4, 6), (4,), (S(1),)) is None
