"""The boxing planner: pure, layouts in, plan out, cached.

On one placement it searches the nd-SBP states for the cheapest sequence of clean axis
steps (see axis_step), merging axes into one flattened group where they hold the same SBP,
plus all-to-alls straight to the target over several axes; the cost is (bytes the busiest
rank sends, number of collectives, number of steps). Between placements it takes the
cheapest of a few routes (see _across): send/recv of the intersecting blocks, one
all-gather over a source replica and the target ranks, or a broadcast, with partial axes
reduced in the source placement first. Either way no rank sends more than the tensor once
plus the reduce-scatter of a partial source.

A blocked split's pieces are boxes of the factored tensor only (sbp/shape.py): a boxing from or
to one is planned there, between ``refactor`` steps (each rank reshapes its piece, no data
moves); a layout the factoring cannot describe (a plain split cutting blocks apart, or other
block counts) is reached through the plain layout with the blocked axes broadcast. Head-tail splits
are planned in head_tail.py.
"""
from __future__ import annotations

import heapq
from functools import lru_cache
from itertools import combinations

from ..sbp.values import broadcast, partial_sum, split
from .axis_step import is_clean, make_step, regroups
from .head_tail import head_tail_steps
from .layout import Layout, intersect
from .plan import Plan, Step
from ..comm.stats import ring_bytes
from ..comm.world import Transfer
from ..sbp.shape import blocked_dims, blocks_problem, numel


@lru_cache(maxsize=4096)
def plan_boxing(src: Layout, dst: Layout) -> Plan:
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise ValueError(f"boxing: source and target must have the same shape and dtype, got {src} and {dst}")
    if src == dst:
        steps = []
    elif src.head_tail or dst.head_tail:
        steps = head_tail_steps(src, dst, plan_boxing)
    elif src.blocked or dst.blocked:
        steps = _through_factored(src, dst)
    elif src.placement == dst.placement:
        steps = _search_or_through_broadcast(src, dst)
    else:
        steps = _across(src, dst)
    return Plan(src, dst, tuple(steps))


def _through_factored(src: Layout, dst: Layout) -> list:
    for lay in (src, dst):
        problem = blocks_problem(lay.shape, lay.placement.hierarchy, lay.nd_sbp)
        if problem:
            raise ValueError(f"boxing: {lay.nd_sbp!r} is not a layout of shape {tuple(lay.shape)}: {problem}")
    pairs = dict(blocked_dims(src.nd_sbp))
    clash = any(pairs.setdefault(d, f) != f for d, f in blocked_dims(dst.nd_sbp).items())
    pairs = tuple(sorted(pairs.items()))
    if not clash and not any(blocks_problem(lay.shape, lay.placement.hierarchy, lay.nd_sbp, pairs)
                             for lay in (src, dst)):
        fsrc, fdst = src.factored(pairs), dst.factored(pairs)
        return [_refactor(src, fsrc), *plan_boxing(fsrc, fdst).steps, _refactor(fdst, dst)]
    plain_src, plain_dst = _unblocked(src), _unblocked(dst)
    return [*plan_boxing(src, plain_src).steps, *plan_boxing(plain_src, plain_dst).steps,
            *plan_boxing(plain_dst, dst).steps]


def _refactor(src: Layout, dst: Layout) -> Step:
    """Each rank reshapes its piece between a layout and its factored form (no data moves)."""
    return Step("refactor", src, dst, (), ())


def _unblocked(layout: Layout) -> Layout:
    """``layout`` with its blocked axes broadcast."""
    return layout.with_sbp(tuple(broadcast if v.is_split and v.blocked else v for v in layout.nd_sbp))


def _values(src: Layout, target: tuple) -> list:
    """The SBP values worth passing through: B, P where either side has it, and splits of the
    dims either side splits (a detour through another dim never moves fewer bytes)."""
    dims = sorted({v.dim for v in src.nd_sbp + target if v.is_split})
    vals = [broadcast] + [split(d) for d in dims]
    if src.has_partial or any(v.is_partial for v in target):
        vals.append(partial_sum)
    return vals


def _search_or_through_broadcast(src: Layout, dst: Layout) -> list:
    """The search's steps, or a gather to broadcast and a local finish where the busiest rank sends
    less that way. The search adds up each step's busiest rank; with uneven pieces the busiest
    ranks of two steps can differ, so a path the search ties with can send less in all."""
    found = _search(src, dst.nd_sbp)
    all_b = tuple(broadcast for _ in src.nd_sbp)
    if all_b in (src.nd_sbp, dst.nd_sbp):
        return found
    through = _search(src, all_b) + _search(src.with_sbp(all_b), dst.nd_sbp)
    return min((found, through), key=lambda steps: Plan(src, dst, tuple(steps)).cost)


def _search(src: Layout, target: tuple) -> list:
    """Dijkstra over nd-SBP states; edges are clean steps on one axis or a merged set of axes,
    and one all-to-all straight to the target where it is valid (see regroups)."""
    if src.nd_sbp == target:
        return []
    naxes = len(target)
    if naxes == 1:
        return [make_step(src, (0,), target[0])]
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
        edges = []
        for axes in subsets:
            x = state[axes[0]]
            if any(state[a] != x for a in axes):
                continue
            for y in values:
                if y == x or not is_clean(state, axes, x, y):
                    continue
                edges.append(make_step(layout, axes, y))
        edges += regroups(layout, target)  # after the axis steps: ties keep those
        for step in edges:
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


def _across(src: Layout, dst: Layout) -> list:
    """The cheapest of a few routes between placements, by (bytes the busiest rank sends,
    collectives, steps):

    - land: reduce partial axes in the source placement, send every target rank the blocks
      of a fully split landing layout (send/recv), finish in the target placement;
    - gather: reduce, then one all-gather over a replica of the source and the target ranks
      (a rank sends at most |T|, however many ranks hold the pieces or want the tensor);
    - broadcast: gather to broadcast in the source, one broadcast feeds the target ranks
      that hold nothing, then slice in the target.
    """
    candidates = []
    all_b_dst = dst.with_sbp((broadcast,) * dst.placement.ndim)
    finish_b = _search(all_b_dst, dst.nd_sbp)  # B -> anything is local
    for reduced in _reductions(src):
        pre = _search(src, reduced)
        moved_from = src.with_sbp(reduced)
        for landing in _landings(dst):
            moved_to = dst.with_sbp(landing)
            candidates.append(pre + [_send_recv_step(moved_from, moved_to)] + _search(moved_to, dst.nd_sbp))
        gather = _gather_step(moved_from, all_b_dst)
        if gather is not None:
            candidates.append(pre + [gather] + finish_b)
    all_b_src = tuple(broadcast for _ in src.nd_sbp)
    candidates.append(_search(src, all_b_src) + _broadcast_steps(src.with_sbp(all_b_src), all_b_dst) + finish_b)
    return min(candidates, key=lambda steps: Plan(src, dst, tuple(steps)).cost)


def _reductions(src: Layout) -> list:
    """Partial-free layouts of the source placement to reduce a partial source to."""
    if not src.has_partial:
        return [src.nd_sbp]
    if len(src.shape) == 0:
        return [tuple(broadcast if v.is_partial else v for v in src.nd_sbp)]
    return list(dict.fromkeys(tuple(split(d) if v.is_partial else v for v in src.nd_sbp)
                              for d in _dims_by_preference(src.shape, src.nd_sbp)))


def _landings(dst: Layout) -> list:
    """Partial-free layouts of the target placement for send/recv to land in."""
    if len(dst.shape) == 0:
        return [tuple(broadcast for _ in dst.nd_sbp)]
    out = []
    for d in _dims_by_preference(dst.shape, dst.nd_sbp):
        out.append(tuple(v if v.is_split else split(d) for v in dst.nd_sbp))  # every rank a distinct block
        out.append(tuple(split(d) if v.is_partial else v for v in dst.nd_sbp))  # replicas received whole
    return list(dict.fromkeys(out))


def _dims_by_preference(shape: tuple, nd_sbp: tuple) -> list:
    """Tensor dims, best first to cut a replicated or partial axis along: largest free ones first."""
    taken = {v.dim for v in nd_sbp if v.is_split}
    return sorted(range(len(shape)), key=lambda d: (d in taken, -shape[d], d))


def _gather_step(src: Layout, dst: Layout):
    """One all-gather over a replica of the partial-free ``src`` and the ranks of the all-B ``dst``.

    The replica's pieces tile the tensor; each holder contributes its piece flattened, the
    other members nothing, and every member unpacks the gathered blocks into the whole
    tensor. A ring all-gather has every rank pass on at most |T|, however many ranks hold
    the pieces or want the tensor. None when the device types differ.
    """
    if src.placement.type != dst.placement.type:
        return None
    replica_axes = [a for a, v in enumerate(src.nd_sbp) if v.is_broadcast]
    replicas = {}
    for r in src.placement.rank_list():
        c = src.placement.coord(r)
        replicas.setdefault(tuple(c[a] for a in replica_axes), []).append(r)
    targets = dst.placement.rank_list()
    # the replica most of whose ranks are targets (fewest extra ranks in the ring)
    replica = max(replicas.values(), key=lambda rep: sum(r in dst.placement for r in rep))
    group = tuple(replica) + tuple(r for r in targets if r not in replica)
    sizes = [numel(src.piece_shape(r)) for r in replica] + [0] * (len(group) - len(replica))
    sent = ring_bytes(group, [n * src.itemsize for n in sizes])
    return Step("all_gather", src, dst, (), (group,), tuple(sorted(sent.items())), sizes=tuple(sizes))


def _broadcast_steps(src: Layout, dst: Layout) -> list:
    """A replicated tensor to a replicated target: target ranks holding it keep their copy, one
    broadcast from a holder feeds the rest (one step, so that both happen)."""
    root = src.placement.rank_list()[0]
    needing = tuple(r for r in dst.placement.rank_list() if r not in src.placement)
    keeping = tuple(r for r in dst.placement.rank_list() if r in src.placement)
    if not needing:
        return [Step("copy", src, dst, (), (keeping,))]
    nbytes = numel(src.shape) * src.itemsize
    return [Step("broadcast", src, dst, (), ((root,) + needing,), ((root, nbytes),), root=root)]


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
