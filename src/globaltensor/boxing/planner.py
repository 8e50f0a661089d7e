"""The boxing planner: pure, layouts in, plan out, cached.

On one placement it searches the nd-SBP states for the cheapest sequence of clean axis
steps (see axis_step), merging axes into one flattened group where they hold the same SBP;
the cost is (bytes the busiest rank sends, number of collectives, number of steps).
Between placements it reduces partial axes in the source placement, moves the
intersecting blocks by send/recv (or broadcasts a replicated tensor), then finishes in the
target placement.
"""
from __future__ import annotations

import heapq
from functools import lru_cache
from itertools import combinations

from ..sbp.values import broadcast, partial_sum, split
from .axis_step import is_clean, make_step
from .layout import Layout, intersect
from .plan import Plan, Step
from ..comm.world import Transfer
from ..sbp.shape import numel


@lru_cache(maxsize=4096)
def plan_boxing(src: Layout, dst: Layout) -> Plan:
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise ValueError(f"boxing: source and target must have the same shape and dtype, got {src} and {dst}")
    if src.placement == dst.placement:
        steps = _search(src, dst.nd_sbp)
    else:
        steps = _across(src, dst)
    return Plan(src, dst, tuple(steps))


def _values(src: Layout, target: tuple) -> list:
    vals = [broadcast] + [split(d) for d in range(len(src.shape))]
    if src.has_partial or any(v.is_partial for v in target):
        vals.append(partial_sum)
    return vals


def _search(src: Layout, target: tuple) -> list:
    """Dijkstra over nd-SBP states; edges are clean steps on one axis or a merged set of axes."""
    if src.nd_sbp == target:
        return []
    naxes = len(target)
    values = _values(src, target)
    subsets = [c for k in range(1, naxes + 1) for c in combinations(range(naxes), k)]
    best = {src.nd_sbp: (0, 0, 0)}
    heap = [((0, 0, 0), 0, src.nd_sbp, None)]
    back = {}
    tie = 0
    while heap:
        cost, _, state, _ = heapq.heappop(heap)
        if state == target:
            break
        if best.get(state) != cost:
            continue
        layout = src.with_sbp(state)
        for axes in subsets:
            x = state[axes[0]]
            if any(state[a] != x for a in axes):
                continue
            for y in values:
                if y == x or not is_clean(state, axes, x, y):
                    continue
                step = make_step(layout, axes, y)
                new = step.dst.nd_sbp
                c = (cost[0] + step.bytes, cost[1] + step.is_collective, cost[2] + 1)
                if new not in best or c < best[new]:
                    best[new] = c
                    back[new] = (state, step)
                    tie += 1
                    heapq.heappush(heap, (c, tie, new, None))
    steps = []
    state = target
    while state != src.nd_sbp:
        state, step = back[state]
        steps.append(step)
    return steps[::-1]


def _largest_free_dim(shape: tuple, nd_sbp: tuple) -> int:
    """The dim a replicated or partial axis is best cut along: the largest one nothing splits yet."""
    taken = {v.dim for v in nd_sbp if v.is_split}
    dims = sorted(range(len(shape)), key=lambda d: (d in taken, -shape[d], d))
    return dims[0]


def _across(src: Layout, dst: Layout) -> list:
    steps = []
    if len(src.shape) == 0:
        reduced = tuple(broadcast if v.is_partial else v for v in src.nd_sbp)
    else:
        d = _largest_free_dim(src.shape, src.nd_sbp)
        reduced = tuple(split(d) if v.is_partial else v for v in src.nd_sbp)
    steps += _search(src, reduced)
    moved_from = src.with_sbp(reduced)
    all_b = lambda nd: all(v.is_broadcast for v in nd)
    if all_b(reduced) and all_b(dst.nd_sbp):
        steps += _broadcast_steps(moved_from, dst)
        return steps
    if len(dst.shape) == 0:
        landing = tuple(broadcast for _ in dst.nd_sbp)
    else:
        d = _largest_free_dim(dst.shape, dst.nd_sbp)
        landing = tuple(split(d) if not v.is_split else v for v in dst.nd_sbp)
    moved_to = dst.with_sbp(landing)
    steps.append(_send_recv_step(moved_from, moved_to))
    steps += _search(moved_to, dst.nd_sbp)
    return steps


def _broadcast_steps(src: Layout, dst: Layout) -> list:
    """A replicated tensor to a replicated target: ranks holding it copy, one broadcast feeds the rest."""
    holders = src.placement.rank_list()
    root = holders[0]
    needing = tuple(r for r in dst.placement.rank_list() if r not in src.placement)
    keeping = tuple(r for r in dst.placement.rank_list() if r in src.placement)
    steps = []
    if keeping:
        steps.append(Step("copy", src, dst, (), (keeping,)))
    if needing:
        group = (root,) + needing
        nbytes = numel(src.shape) * src.itemsize
        steps.append(Step("broadcast", src, dst, (), (group,), ((root, nbytes),), root=root))
    return steps


def _send_recv_step(src: Layout, dst: Layout) -> Step:
    """Every target rank receives the blocks of its piece from one replica of the (partial-free) source.

    A target rank that is itself a source replica takes its own blocks; the others are
    spread over the replicas round-robin. Transfers are listed by target rank, then source
    rank, the same on every process.
    """
    src_ranks = src.placement.rank_list()
    replica_axes = [a for a, v in enumerate(src.nd_sbp) if v.is_broadcast]
    replicas = {}
    for r in src_ranks:
        c = src.placement.coord(r)
        replicas.setdefault(tuple(c[a] for a in replica_axes), []).append(r)
    replica_list = list(replicas.values())
    transfers, sent = [], {}
    for t, r in enumerate(dst.placement.rank_list()):
        box = dst.box(r)
        if any(l == 0 for _, l in box) and len(box):
            continue
        chosen = next((rep for rep in replica_list if r in rep), replica_list[t % len(replica_list)])
        for s in chosen:
            inter = intersect(src.box(s), box) if len(box) else ()
            if inter is None:
                continue
            shape = tuple(l for _, l in inter)
            transfers.append(Transfer(s, r, shape))
            if s != r:
                sent[s] = sent.get(s, 0) + numel(shape) * src.itemsize
    parties = tuple(sorted({t.src for t in transfers} | {t.dst for t in transfers}))
    return Step("send_recv", src, dst, (), (parties,), tuple(sorted(sent.items())), tuple(transfers))
