"""Helpers for the boxing tests: logical tensors, their pieces under a layout, and checks."""
from __future__ import annotations

import itertools

import torch
from hypothesis import strategies as st

import globaltensor as gt
from globaltensor.boxing import Layout, execute, plan_boxing
from globaltensor.boxing.layout import relative, take
from globaltensor.sbp import blocks_problem, broadcast, numel, partial_sum, piece_ranges, split

S, B, P = split, broadcast, partial_sum


def sbp_values(ndim: int, partial: bool = True) -> list:
    vals = [B] + [S(d) for d in range(ndim)]
    return vals + [P] if partial else vals


def small_integers(shape, dtype=torch.float64, seed=0) -> torch.Tensor:
    """A random logical tensor with small integer values (sums stay exact)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-50, 50, tuple(shape), generator=g).to(dtype)


def make_pieces(layout: Layout, t: torch.Tensor, seed: int = 0) -> dict:
    """Every rank's piece of ``t`` under ``layout``; P axes get genuinely partial random summands.

    Pieces at coordinates that differ only on B axes are equal; over the coordinates of the
    P axes the pieces are random tensors summing to the block the S axes give.
    """
    g = torch.Generator().manual_seed(seed + 1)
    pl = layout.placement
    h = pl.hierarchy
    p_axes = [a for a, v in enumerate(layout.nd_sbp) if v.is_partial]
    s_axes = [a for a, v in enumerate(layout.nd_sbp) if v.is_split]
    summands = {}
    pieces = {}
    for r in pl.rank_list():
        c = pl.coord(r)
        block = take(t, layout.box(r))
        if not p_axes:
            pieces[r] = block.clone()
            continue
        key = tuple(c[a] for a in s_axes)
        if key not in summands:
            combos = list(itertools.product(*(range(h[a]) for a in p_axes)))
            parts = [torch.randint(-20, 20, block.shape, generator=g).to(t.dtype) for _ in combos[1:]]
            first = block.clone()
            for x in parts:
                first -= x
            summands[key] = dict(zip(combos, [first] + parts))
        pieces[r] = summands[key][tuple(c[a] for a in p_axes)].clone()
    return pieces


def reconstruct(layout: Layout, pieces: dict, exact: bool = True) -> torch.Tensor:
    """The logical tensor the pieces describe, by the nd-SBP semantics (last axis first).

    Checks every piece's shape and that replicas along B axes agree (exactly when nothing
    partial lies below them, else to tolerance).
    """
    pl, nd, shape = layout.placement, layout.nd_sbp, tuple(layout.shape)
    h = pl.hierarchy
    for r in pl.rank_list():
        assert tuple(pieces[r].shape) == layout.piece_shape(r), (r, tuple(pieces[r].shape), layout.piece_shape(r))
        assert pieces[r].dtype == layout.dtype

    def sub(c):
        k = len(c)
        if k == len(h):
            return pieces[int(pl.ranks[c])]
        box = piece_ranges(shape, h[:k], nd[:k], c)
        kids = [sub(c + (i,)) for i in range(h[k])]
        v = nd[k]
        if v.is_split:
            out = torch.empty(tuple(l for _, l in box), dtype=layout.dtype)
            for i, kid in enumerate(kids):
                kbox = piece_ranges(shape, h[:k + 1], nd[:k + 1], c + (i,))
                take(out, relative(kbox, box)).copy_(kid)
            return out
        if v.is_broadcast:
            deeper_partial = any(w.is_partial for w in nd[k + 1:])
            for kid in kids[1:]:
                if exact and not deeper_partial:
                    assert torch.equal(kid, kids[0]), "broadcast replicas differ"
                else:
                    assert torch.allclose(kid, kids[0]), "broadcast replicas differ"
            return kids[0]
        total = kids[0].clone()
        for kid in kids[1:]:
            total += kid
        return total

    return sub(())


def check_pieces(layout: Layout, pieces: dict, t: torch.Tensor) -> None:
    """The pieces hold ``t`` under ``layout``: exactly when partial-free, to tolerance otherwise."""
    pl = layout.placement
    assert set(pieces) == set(pl.rank_list()), (sorted(pieces), pl.rank_list())
    if not layout.has_partial:
        for r in pl.rank_list():
            want = take(t, layout.box(r))
            assert tuple(pieces[r].shape) == tuple(want.shape) == layout.piece_shape(r)
            assert torch.equal(pieces[r], want), f"rank {r}: piece differs under {layout.nd_sbp}"
    else:
        got = reconstruct(layout, pieces)
        assert torch.allclose(got, t), f"partial pieces do not sum to the tensor under {layout.nd_sbp}"


def run_plan(src: Layout, dst: Layout, t: torch.Tensor, seed: int = 0):
    """Plan and execute src -> dst on the current world from pieces of ``t``; check and return the plan."""
    plan = plan_boxing(src, dst)
    pieces = make_pieces(src, t, seed)
    check_pieces(src, pieces, t)
    with gt.comm_stats() as st:
        out = execute(plan, pieces, gt.get_world())
    check_pieces(dst, out, t)
    assert st.bytes_sent == plan.bytes, (st.bytes_sent, plan.bytes, plan)
    ranks = set(st.per_rank) | set(plan.bytes_per_rank)
    assert {r: st.per_rank.get(r, 0) for r in ranks} == {r: plan.bytes_per_rank.get(r, 0) for r in ranks}
    assert st.ops() == expected_ops(plan), (st.ops(), plan)
    return plan, st


def expected_ops(plan) -> list:
    """The collectives running ``plan`` issues: one per group of two or more ranks."""
    ops = []
    for s in plan.steps:
        if not s.is_collective:
            continue
        if s.op in ("send_recv", "broadcast"):
            ops.append(s.op)
        else:
            ops += [s.op for g in s.groups if len(g) > 1]
    return ops


def layout(shape, placement, sbp, dtype=torch.float64) -> Layout:
    nd = sbp if isinstance(sbp, tuple) else (sbp,)
    return Layout(tuple(shape), dtype, placement, nd)


def nbytes(shape, dtype=torch.float64) -> int:
    return numel(shape) * torch.empty((), dtype=dtype).element_size()


RANKS = {"1d": [0, 1, 2, 3], "2x2": [[0, 1], [2, 3]], "2x3": [[0, 1, 2], [3, 4, 5]]}


def draw_sbp(data, values: list, kind: str):
    """One SBP value of ``values`` for a 1-D placement, a pair of them for a 2-D one (hypothesis)."""
    draw = lambda: data.draw(st.sampled_from(values))      # noqa: E731
    return draw() if kind == "1d" else (draw(), draw())


def check_conversion(shape: tuple, kind: str, src, dst) -> None:
    """``src -> dst`` on the placement ``kind`` equals distributing the logical tensor to ``dst``
    directly (float64 integers, exact); a partial source is made from the broadcast one (one rank
    keeps the value). A pair of layouts that does not describe ``shape`` is skipped, as the
    dispatcher never offers it."""
    as_nd = lambda v: v if isinstance(v, tuple) else (v,)    # noqa: E731
    ranks = RANKS[kind]
    hierarchy = (len(ranks),) if kind == "1d" else (len(ranks), len(ranks[0]))
    if blocks_problem(shape, hierarchy, as_nd(src)) or blocks_problem(shape, hierarchy, as_nd(dst)):
        return
    x = torch.randint(-50, 50, shape).to(torch.float64)
    with gt.simulate(6):
        p = gt.placement("cpu", ranks)
        start = gt.distribute(x, p, tuple(B if v == P else v for v in as_nd(src))).to_global(sbp=src)
        got = start.to_global(sbp=dst)
        assert got.sbp == as_nd(dst)
        assert torch.equal(got.full_tensor(), x), (src, dst)
        if P not in as_nd(dst):
            want = gt.distribute(x, p, dst)
            assert all(torch.equal(got._pieces[r], want._pieces[r]) for r in want._pieces), (src, dst)
