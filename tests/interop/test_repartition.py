"""DTensor's torch.chunk-style uneven split beside globaltensor's balanced one, and the moves between
them, on simulated ranks (the DTensor conversions themselves run on launched processes:
tests/multiprocess/test_dtensor.py)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import globaltensor as gt
from globaltensor.interop.chunk_layout import chunk_range, layouts_agree, piece_box, repartition_moves
from globaltensor.interop.repartition import repartition

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum


@given(n=st.integers(0, 13), k=st.integers(1, 5))
def test_chunk_range_is_torch_chunk(n, k):
    sizes = [len(c) for c in torch.arange(n).chunk(k)] if n else []
    sizes += [0] * (k - len(sizes))
    starts = [chunk_range(n, k, i)[0] for i in range(k)]
    assert [chunk_range(n, k, i)[1] for i in range(k)] == sizes
    assert all(s == sum(sizes[:i]) for i, s in enumerate(starts))


def pieces_of(x, placement, nd, style):
    def box(rank):
        return piece_box(tuple(x.shape), placement.hierarchy, nd, placement.coord(rank), style)

    out = {}
    for r in placement.rank_list():
        piece = x
        for d, (start, length) in enumerate(box(r)):
            piece = piece.narrow(d, start, length)
        out[r] = piece.clone()
    return out


SBP = st.sampled_from([S(0), S(1), B, P])


@settings(max_examples=40, deadline=None)
@given(shape=st.tuples(st.integers(0, 9), st.integers(1, 7)), nd=st.one_of(SBP.map(lambda v: (v,)), st.tuples(SBP, SBP)),
       ranks_2d=st.sampled_from([[[0, 1], [2, 3]], [[3, 1, 0, 2]]]))
def test_repartition_moves_pieces_between_styles(shape, nd, ranks_2d):
    """Both ways; every piece exact (a partial-sum tensor's addends move as data, each on its own)."""
    x = torch.randn(shape, dtype=torch.float64)
    with gt.simulate(4):
        placement = gt.placement("cpu", [0, 1, 2, 3] if len(nd) == 1 else ranks_2d)
        balanced = pieces_of(x, placement, nd, "balanced")
        chunked = repartition(balanced, shape, x.dtype, placement, nd, "balanced", "chunk")
        want = pieces_of(x, placement, nd, "chunk")
        assert all(torch.equal(chunked[r], want[r]) for r in want)
        back = repartition(chunked, shape, x.dtype, placement, nd, "chunk", "balanced")
        assert all(torch.equal(back[r], balanced[r]) for r in balanced)


def test_only_the_rows_that_change_rank_move(world4):
    """6 rows over 4 ranks: balanced 2 2 1 1, chunk 2 2 2 0: rank 3 sends its one row to rank 2; ranks 0
    and 1 keep their pieces themselves (the same storage)."""
    p = gt.placement("cpu", [0, 1, 2, 3])
    x = torch.arange(30.0).reshape(6, 5)
    balanced = pieces_of(x, p, (S(0),), "balanced")
    moves = repartition_moves((6, 5), (4,), (S(0),), "balanced", "chunk")
    assert [(m.src, m.dst, m.region) for m in moves if m.src != m.dst] == [((3,), (2,), ((5, 1), (0, 5)))]
    with gt.comm_stats() as stats:
        chunked = repartition(balanced, (6, 5), x.dtype, p, (S(0),), "balanced", "chunk")
    assert stats.bytes_sent == 5 * 4
    assert chunked[0] is balanced[0] and chunked[1] is balanced[1]
    assert torch.equal(chunked[2], x[4:6]) and chunked[3].shape == (0, 5)


@pytest.mark.parametrize("shape,hierarchy,nd,agree", [
    ((8, 4), (4,), (S(0),), True), ((7, 4), (4,), (S(0),), True), ((6, 4), (4,), (S(0),), False),
    ((6, 4), (4,), (B,), True), ((5, 5), (2, 2), (S(0), S(1)), True), ((6, 3), (2, 2), (S(0), S(0)), True), ((3, 6), (1, 4), (S(0), S(1)), False),
])
def test_layouts_agree(shape, hierarchy, nd, agree):
    """Over 2 ranks the styles always agree (ceil then floor); over 4, 6 rows differ and 7 do not."""
    assert layouts_agree(shape, hierarchy, nd) is agree


def test_agreeing_layouts_move_nothing(world4):
    p = gt.placement("cpu", [[0, 1], [2, 3]])
    pieces = pieces_of(torch.randn(8, 6), p, (S(0), B), "balanced")
    with gt.comm_stats() as stats:
        out = repartition(pieces, (8, 6), torch.float32, p, (S(0), B), "balanced", "chunk")
    assert stats.bytes_sent == 0 and all(out[r] is pieces[r] for r in pieces)
