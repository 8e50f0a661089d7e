"""The simulated world's collectives and their byte accounting (gt.comm_stats)."""
import pytest
import torch

import globaltensor as gt
from globaltensor.comm import Transfer, stats
from globaltensor.comm.simulated import SimulatedWorld

from boxing_helpers import B, P, S, layout, small_integers, run_plan


def ones(*shape, v=1.0):
    return torch.full(shape, v, dtype=torch.float32)


@pytest.mark.parametrize("n", [0, -1, 2.0, True, "4", None])
def test_bad_world_size(n):
    with pytest.raises(ValueError, match=r"simulate\(n\): expected a positive number of ranks"):
        gt.simulate(n)


def test_simulate_context_restores():
    with gt.simulate(3) as w:
        assert gt.world_size() == 3 and gt.get_world() is w and w.simulated
        assert w.local_ranks == (0, 1, 2) and gt.rank() == 0
        with gt.simulate(5):
            assert gt.world_size() == 5
        assert gt.world_size() == 3


def test_all_gather_uneven():
    w = SimulatedWorld(3)
    pieces = {0: ones(2, 2, v=0), 1: ones(2, 2, v=1), 2: ones(1, 2, v=2)}
    with gt.comm_stats() as st:
        out = w.all_gather((0, 1, 2), pieces, 0, [2, 2, 1], (5, 2), torch.float32)
    want = torch.cat(list(pieces.values()))
    assert all(torch.equal(out[r], want) for r in range(3))
    # ring: rank i passes on all but rank i+1's piece (4 bytes per element, 2 per row)
    assert st.records[0].bytes_per_rank == {0: (5 - 2) * 8, 1: (5 - 1) * 8, 2: (5 - 2) * 8}
    assert st.bytes_sent == 32 and st.ops() == ["all_gather"] and st.count == 1
    out[1].add_(1)  # results do not alias one another
    assert torch.equal(out[0], want)


def test_reduce_scatter_and_all_reduce():
    w = SimulatedWorld(4)
    group = (2, 0, 3, 1)  # group order differs from rank order
    pieces = {r: ones(7, 3, v=r + 1) for r in group}
    with gt.comm_stats() as st:
        rs = w.reduce_scatter(group, pieces, 0, [2, 2, 2, 1])
        ar = w.all_reduce(group, pieces)
    total = ones(7, 3, v=10)
    assert [tuple(rs[r].shape) for r in group] == [(2, 3), (2, 3), (2, 3), (1, 3)]
    assert all(torch.equal(rs[r], total[:rs[r].shape[0]]) for r in group)
    assert all(torch.equal(ar[r], total) for r in group)
    rs_bytes, ar_bytes = st.records[0].bytes_per_rank, st.records[1].bytes_per_rank
    assert rs_bytes == {2: 21 * 4 - 6 * 4, 0: 21 * 4 - 6 * 4, 3: 21 * 4 - 3 * 4, 1: 21 * 4 - 6 * 4}
    # all-reduce: twice a ring reduce-scatter of 21 elements in chunks 6, 5, 5, 5
    assert ar_bytes == {2: 2 * (21 - 5) * 4, 0: 2 * (21 - 5) * 4, 3: 2 * (21 - 5) * 4, 1: 2 * (21 - 6) * 4}
    for r in group:  # inputs untouched
        assert torch.equal(pieces[r], ones(7, 3, v=r + 1))


def test_all_reduce_in_place_writes_the_sums_into_the_pieces():
    """As a process world's backend does (a gradient bucket's flat buffer): the pieces given hold
    the sum afterwards and are what comes back, counted as an all-reduce."""
    w = SimulatedWorld(3)
    group = (1, 2, 0)
    pieces = {r: ones(5, v=r + 1) for r in group}
    with gt.comm_stats() as st:
        out = w.all_reduce_in_place(group, pieces)
    assert st.ops() == ["all_reduce"]
    assert all(out[r] is pieces[r] and torch.equal(pieces[r], ones(5, v=6)) for r in group)


def test_all_to_all_broadcast_send_recv():
    w = SimulatedWorld(3)
    group = (0, 1, 2)
    chunks = {s: [ones(1, 2, v=10 * s + d) for d in range(3)] for s in group}
    shapes = [[(1, 2)] * 3 for _ in group]
    with gt.comm_stats() as st:
        rows = {d: ((3, 2), tuple(((0, s, 1),) for s in group)) for d in group}    # block s is row s
        got = w.all_to_all(group, chunks, shapes, torch.float32, rows)
        b = w.broadcast((1, 0, 2), 1, {1: ones(4, v=7)}, (4,), torch.float32, "cpu")
        sr = w.send_recv([Transfer(0, 2, (3,)), Transfer(1, 1, (2,))], {0: ones(3, v=5), 1: ones(2, v=6)},
                         torch.float32, "cpu")
    assert all(torch.equal(got[d][s:s + 1], ones(1, 2, v=10 * s + d)) for s in group for d in group)
    assert all(torch.equal(b[r], ones(4, v=7)) for r in (0, 1, 2))
    assert torch.equal(sr[0], ones(3, v=5)) and torch.equal(sr[1], ones(2, v=6))
    assert st.ops() == ["all_to_all", "broadcast", "send_recv"]
    assert st.records[0].bytes_per_rank == {0: 16, 1: 16, 2: 16}
    assert st.records[1].bytes_per_rank == {1: 16}
    assert st.records[2].bytes_per_rank == {0: 12}  # a rank sending to itself moves nothing
    assert st.per_rank[0] == 16 + 12 and st.per_rank[1] == 16 + 16 and st.bytes_sent == 32


def test_comm_stats_nesting_and_exceptions():
    w = SimulatedWorld(2)
    pieces = {0: ones(2), 1: ones(2)}
    with gt.comm_stats() as outer:
        with gt.comm_stats() as inner:  # equal (empty) recorders: the inner one leaves, not the outer
            pass
        w.all_reduce((0, 1), pieces)
        with gt.comm_stats() as inner2:
            w.all_reduce((0, 1), pieces)
        with pytest.raises(RuntimeError):
            with gt.comm_stats():
                raise RuntimeError("boom")
    assert inner.count == 0 and inner2.count == 1 and outer.count == 2
    assert outer.bytes_sent == 2 * inner2.bytes_sent == 2 * 8
    assert not stats.recording()
    w.all_reduce((0, 1), pieces)  # nothing records outside
    assert outer.count == 2


def test_single_rank_groups_issue_no_collective():
    """An axis of size one: its conversions are local (the one rank's piece is the whole)."""
    with gt.simulate(2):
        pl = gt.placement("cpu", [[0, 1]])  # hierarchy (1, 2)
        t = small_integers((4, 3))
        for x, y in [((P, S(0)), (B, S(0))), ((S(1), S(0)), (B, S(0))), ((S(0), B), (S(1), B))]:
            plan, st = run_plan(layout(t.shape, pl, x), layout(t.shape, pl, y), t)
            assert st.count == 0 and plan.bytes == 0 and plan.collectives == []
