"""Boxing from and to head-tail splits (``S(d, order="head_tail")``: rank ``r`` of ``W`` holds chunks ``r``
and ``2W - 1 - r`` of the dim cut in ``2W``): every conversion equals distributing the logical tensor
to the target directly, and a head-tail piece is its two chunks, cut by hand here (float64, exact)."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import globaltensor as gt
from globaltensor.boxing import plan_boxing
from boxing_helpers import check_conversion, draw_sbp
from globaltensor.sbp import broadcast as B, partial_sum as P, split as S


def HT(d: int, f: int = 1):
    return S(d, blocks=f, order="head_tail")


def chunks_by_hand(x: torch.Tensor, dim: int, width: int, rank: int, blocks: int = 1) -> torch.Tensor:
    """Rank ``rank``'s head-tail piece: per block, balanced chunks ``rank`` and ``2W - 1 - rank``."""
    parts = []
    for block in x.chunk(blocks, dim):
        cut = torch.tensor_split(block, 2 * width, dim)       # balanced: the first n % 2W one longer
        parts += [cut[rank], cut[2 * width - 1 - rank]]
    return torch.cat(parts, dim)


@pytest.mark.parametrize("n", [8, 16, 11, 5, 3])
def test_a_head_tail_piece_is_its_two_chunks(n):
    x = torch.arange(2 * n * 3, dtype=torch.float64).reshape(2, n, 3)
    with gt.simulate(4):
        p = gt.placement("cpu", [0, 1, 2, 3])
        g = gt.distribute(x, p, HT(1))
        for r in range(4):
            assert torch.equal(g._pieces[r], chunks_by_hand(x, 1, 4, r))
        assert torch.equal(g.full_tensor(), x)


def test_blocked_head_tail_pieces_are_two_chunks_of_each_block():
    x = torch.arange(3 * 16, dtype=torch.float64).reshape(3 * 16, 1)
    with gt.simulate(4):
        p = gt.placement("cpu", [0, 1, 2, 3])
        g = gt.distribute(x, p, HT(0, 3))
        for r in range(4):
            assert torch.equal(g._pieces[r], chunks_by_hand(x, 0, 4, r, blocks=3))


def _values() -> list:
    return [B, P, S(0), S(1), HT(1), S(1, blocks=2), HT(1, 2), HT(0)]


@settings(max_examples=80, deadline=None)
@given(m=st.integers(1, 6), rows=st.integers(1, 5), kind=st.sampled_from(["1d", "2x2", "2x3"]), data=st.data())
def test_every_conversion_to_and_from_head_tail_splits_equals_one_device(m, rows, kind, data):
    shape = (rows, 2 * m)
    check_conversion(shape, kind, draw_sbp(data, _values(), kind), draw_sbp(data, _values(), kind))


def test_the_plans_a_head_tail_split_takes():
    """From broadcast: a local cut, no bytes. To the plain split of the dim: one send_recv, each rank
    sending the chunks it holds that the plain split gives another rank -- 16 columns, 8 chunks of
    2: rank 0 holds chunks 0 and 7 and keeps 0, rank 1 holds 1 and 6 and keeps neither (plain gives
    it 2 and 3). Beside it, the other axes convert as in plain order (even chunks): a partial axis
    is reduce-scattered only."""
    with gt.simulate(4):
        p = gt.placement("cpu", [0, 1, 2, 3])
        ht = gt.distribute(torch.zeros(2, 16, dtype=torch.float64), p, HT(1))._layout
        cut = plan_boxing(ht.with_sbp((B,)), ht)
        assert [s.op for s in cut.steps] == ["slice"] and cut.bytes == 0
        to_plain = plan_boxing(ht, ht.with_sbp((S(1),)))
        assert [s.op for s in to_plain.steps] == ["send_recv"]
        chunk = 2 * 2 * 8                                                     # 2 rows x 2 columns of float64
        assert to_plain.bytes_per_rank == {0: chunk, 1: 2 * chunk, 2: chunk, 3: 2 * chunk}
        grid = gt.placement("cpu", [[0, 1], [2, 3]])
        partial = gt.distribute(torch.zeros(4, 16, dtype=torch.float64), grid, (B, HT(1)))._layout
        beside = plan_boxing(partial.with_sbp((P, HT(1))), partial.with_sbp((S(0), HT(1))))
        assert [s.op for s in beside.steps] == ["reduce_scatter"]
