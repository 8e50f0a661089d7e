"""The boxing executor: runs a plan's steps on a world, over the pieces this process holds.

Pieces are ``{rank: tensor}`` for the ranks of the layout's placement that live in this
process. Every rank walks the same steps and groups in the same order, so collectives are
issued identically everywhere; a rank outside a group skips it (still counting its bytes in
gt.comm_stats(), so every process counts every rank alike).
"""
from __future__ import annotations

import torch

from ..observe import context as attribution
from ..observe.consistency import CHECK as _check, confirm_boxing
from ..comm.world import World, narrowed, tile_places
from .layout import intersect, relative, take
from .plan import Plan, Step


def execute(plan: Plan, pieces: dict, world: World) -> dict:
    return ready(plan, world).run(pieces)


class Ready:
    """A plan made ready to run in one world: each step's runner and its meta -- what the runner
    needs that follows from the step and from which ranks this process holds (groups, boxes,
    cuts, shapes) -- worked out once, so that a conversion already planned pays only its data
    movement. Making it ready also makes the steps' groups ready, on every rank at the same
    point of the same program (see World.prepare_groups)."""
    __slots__ = ("plan", "world", "steps")

    def __init__(self, plan: Plan, world: World):
        self.plan, self.world = plan, world
        steps = []
        for step in plan.steps:
            if step.is_collective:
                world.prepare_groups(step.groups)
            prepare, run = _RUNNERS[step.op]
            steps.append((step, run, prepare(step, world)))
        self.steps = tuple(steps)

    def run(self, pieces: dict) -> dict:
        if _check.enabled:
            confirm_boxing(self.plan, pieces, self.world)
        if attribution.on:              # a comm_profile is open, or boxings are logged
            return attribution.within_boxing(self.plan, self._steps, pieces, self.world)
        world = self.world
        for step, run, meta in self.steps:
            pieces = run(step, meta, pieces, world)
        return pieces

    def _steps(self, plan: Plan, pieces: dict, world: World) -> dict:
        for step, run, meta in self.steps:
            pieces = run(step, meta, pieces, world)
        return pieces


_READY: dict = {}       # (id(plan), id(world)) -> Ready, which keeps both ids in use
_READY_MAX = 4096


def ready(plan: Plan, world: World) -> Ready:
    """``plan`` made ready to run in ``world`` (made on its first run there, then kept)."""
    r = _READY.get((id(plan), id(world)))
    if r is None:
        if len(_READY) >= _READY_MAX:
            _READY.clear()
        r = _READY[(id(plan), id(world))] = Ready(plan, world)
    return r


def _no_meta(step: Step, world: World) -> None:
    return None


def _cuts(rel: tuple, shape: tuple) -> tuple:
    """``(dim, start, length)`` for each dim where the box ``rel`` does not span ``shape``."""
    return tuple((d, s, l) for d, ((s, l), n) in enumerate(zip(rel, shape)) if s != 0 or l != n)


def _local(group, world):
    return [r for r in group if world.holds(r)]


def _skip(step: Step, group, world: World) -> None:
    """This process holds no rank of ``group``: count its collective all the same, so that every
    process's gt.comm_stats() sees every rank's bytes (the plan knows them from global meta)."""
    world.count(step.op, group, {r: b for r, b in step.bytes_per_rank if r in group})


def _groups(step: Step, world: World) -> tuple:
    """``(group, the group's ranks held here)`` for each group of the step."""
    return tuple((g, tuple(_local(g, world))) for g in step.groups)


def _groups_here(step: Step, groups: tuple, pieces, world, out):
    """Of ``groups`` (see _groups), those that need their collective run here, with any meta
    beside them: a group of one rank is settled into ``out`` (its piece already is the result:
    one rank's S, B and P agree), one held nowhere here is only counted."""
    for g, mine, *rest in groups:
        if len(g) == 1:
            if g[0] in pieces:
                out[g[0]] = pieces[g[0]].clone()
        elif mine:
            yield (g, mine, *rest)
        else:
            _skip(step, g, world)


def _box_shape(box) -> tuple:
    return tuple(l for _, l in box)


def _prepare_all_gather(step: Step, world: World):
    if not step.axes:
        return None
    dim = step.src.nd_sbp[step.axes[0]].dim
    return dim, tuple((g, mine, [step.src.box(r)[dim][1] for r in g], _box_shape(step.dst.box(g[0])))
                      for g, mine in _groups(step, world))


def _all_gather(step: Step, meta, pieces, world):
    if meta is None:
        return _all_gather_across(step, pieces, world)
    dim, groups = meta
    out = {}
    for g, mine, sizes, full in _groups_here(step, groups, pieces, world, out):
        out.update(world.all_gather(g, {r: pieces[r] for r in mine}, dim, sizes, full, step.src.dtype))
    return out


def _all_gather_across(step: Step, pieces, world):
    """The members of a source replica contribute their pieces flattened, the other members
    nothing; every member unpacks the blocks into the whole tensor, target ranks keep it."""
    src, dst = step.src, step.dst
    g = step.groups[0]
    mine = _local(g, world)
    if not mine:
        _skip(step, g, world)
        return {}
    device = lambda r: world.device(dst.placement.type, r)
    size_of = dict(zip(g, step.sizes))
    contrib = {r: pieces[r].reshape(-1) if size_of[r] else torch.empty(0, dtype=src.dtype, device=device(r))
               for r in mine}
    got = world.all_gather(g, contrib, 0, step.sizes, (sum(step.sizes),), src.dtype)
    out = {}
    for r in mine:
        if r not in dst.placement:
            continue
        flat = got[r].to(device(r))
        whole = torch.empty(tuple(src.shape), dtype=src.dtype, device=device(r))
        offset = 0
        for m, n in zip(g, step.sizes):
            if n:
                box = src.box(m)
                take(whole, box).copy_(flat[offset:offset + n].view(_box_shape(box)))
                offset += n
        out[r] = whole
    return out


def _prepare_reduce_scatter(step: Step, world: World):
    dim = step.dst.nd_sbp[step.axes[0]].dim
    return dim, tuple((g, mine, [step.dst.box(r)[dim][1] for r in g]) for g, mine in _groups(step, world))


def _reduce_scatter(step: Step, meta, pieces, world):
    dim, groups = meta
    out = {}
    for g, mine, sizes in _groups_here(step, groups, pieces, world, out):
        out.update(world.reduce_scatter(g, {r: pieces[r] for r in mine}, dim, sizes))
    return out


def _all_reduce(step: Step, groups, pieces, world):
    out = {}
    for g, mine in _groups_here(step, groups, pieces, world, out):
        out.update(world.all_reduce(g, {r: pieces[r] for r in mine}))
    return out


def _prepare_all_to_all(step: Step, world: World):
    """Per group: the block shapes every member sends every member; for each member held here
    the cuts of its piece it sends (None: an empty block) and how its piece is tiled by the
    blocks it receives (its shape, and each block's cuts of it)."""
    src, dst = step.src, step.dst
    zero = (0,) * len(src.shape)
    out = []
    for g, mine in _groups(step, world):
        blocks = [[intersect(src.box(s), dst.box(d)) for d in g] for s in g]
        shapes = [[_box_shape(b) if b else zero for b in row] for row in blocks]
        sends = {s: [_cuts(relative(b, src.box(s)), src.piece_shape(s)) if b else None for b in blocks[i]]
                 for i, s in enumerate(g) if s in mine}
        tiles = {d: _tile(dst.box(d), [blocks[i][j] for i in range(len(g))]) for j, d in enumerate(g) if d in mine}
        out.append((g, mine, shapes, sends, tiles))
    return tuple(out)


def _all_to_all(step: Step, groups, pieces, world):
    dtype = step.src.dtype
    out = {}
    for g, mine, shapes, sends, tiles in _groups_here(step, groups, pieces, world, out):
        chunks = {}
        for i, s in enumerate(g):
            if s in sends:
                t = pieces[s]
                chunks[s] = [narrowed(t, c) if c is not None else t.new_empty(shapes[i][j])
                             for j, c in enumerate(sends[s])]
        out.update(world.all_to_all(g, chunks, shapes, dtype, tiles))
    return out


def _tile(box, blocks) -> tuple:
    """How parts covering ``blocks`` (boxes, None for an empty part) tile a piece of ``box``: the
    piece's shape and each part's cuts of it (None: an empty part); see comm's ``tile_places``."""
    shape = _box_shape(box)
    return shape, tuple(_cuts(relative(b, box), shape) if b is not None else None for b in blocks)


def _prepare_slice(step: Step, world: World) -> dict:
    """Per rank held here: the cuts of its target box in its piece; to a head-tail target, the target
    piece's shape and, per box it holds, where the box lies in it and its cuts in the source piece."""
    src, dst = step.src, step.dst
    if dst.head_tail:
        return {r: (dst.piece_shape(r), tuple((_cuts(placed, dst.piece_shape(r)),
                                               _cuts(relative(whole, src.box(r)), src.piece_shape(r)))
                                              for whole, placed in dst.cells(r)))
                for r in src.placement.rank_list() if world.holds(r)}
    return {r: _cuts(relative(dst.box(r), src.box(r)), src.piece_shape(r))
            for r in src.placement.rank_list() if world.holds(r)}


def _slice(step: Step, cuts, pieces, world):
    if step.dst.head_tail:
        return {r: _assembled(t, *cuts[r]) for r, t in pieces.items()}
    out = {}
    for r, t in pieces.items():         # a loop, not a comprehension and narrowed: fewer Python calls
        for d, s, l in cuts[r]:
            t = t.narrow(d, s, l)
        out[r] = t.clone()
    return out


def _assembled(t, shape, parts) -> torch.Tensor:
    """A new tensor of ``shape`` whose part at each ``(place cuts, source cuts)`` is ``t``'s."""
    out = t.new_empty(shape)
    for place, source in parts:
        narrowed(out, place).copy_(narrowed(t, source))
    return out


def _prepare_to_partial(step: Step, world: World) -> dict:
    """Per rank held here: B->P, whether it keeps the value (the group's first rank); S->P, the
    piece's shape, whether to zero all of it (when its block is not one slab along one dim), the
    slabs to zero otherwise (either side of the block along the split dim), as ``(dim, start,
    length)``, and the cuts of its block."""
    x = step.src.nd_sbp[step.axes[0]]
    out = {}
    for g in step.groups:
        for i, r in enumerate(g):
            if not world.holds(r):
                continue
            if x.is_broadcast:
                out[r] = i == 0
                continue
            dbox = step.dst.box(r)
            shape = _box_shape(dbox)
            block = _cuts(relative(step.src.box(r), dbox), shape)
            slabs = ()
            if len(block) == 1:
                d, s, l = block[0]
                slabs = tuple((d, a, n) for a, n in ((0, s), (s + l, shape[d] - s - l)) if n)
            out[r] = (shape, len(block) > 1, slabs, block)
    return out


def _to_partial(step: Step, meta, pieces, world):
    """S->P: each rank pads its block with zeros; B->P: the group's first rank keeps the value."""
    out = {}
    for r, how in meta.items():
        t = pieces[r]
        if how is True:
            out[r] = t.clone()
        elif how is False:
            out[r] = torch.zeros_like(t)
        else:
            shape, zero_all, slabs, block = how
            z = t.new_empty(shape)
            if zero_all:
                z.zero_()
            for d, s, l in slabs:
                z.narrow(d, s, l).zero_()
            narrowed(z, block).copy_(t)
            out[r] = z
    return out


def _copy(step: Step, meta, pieces, world):
    device = lambda r: world.device(step.dst.placement.type, r)
    return {r: pieces[r].to(device(r), copy=True) for r in step.groups[0] if world.holds(r)}


def _broadcast(step: Step, meta, pieces, world):
    """Target ranks that hold the (replicated) source keep it; the root feeds the others."""
    device = lambda r: world.device(step.dst.placement.type, r)
    out = {r: pieces[r].to(device(r), copy=True) for r in step.dst.placement.rank_list()
           if r in step.src.placement and world.holds(r)}
    g = step.groups[0]
    mine = _local(g, world)
    if mine:
        got = world.broadcast(g, step.root, {r: pieces[r] for r in mine if r == step.root},
                              tuple(step.src.shape), step.src.dtype, step.src.placement.type)
        out.update({r: got[r].to(device(r)) for r in mine if r in step.dst.placement and r not in out})
    else:
        _skip(step, g, world)
    return out


def _prepare_send_recv(step: Step, world: World) -> tuple:
    """The cuts of the source piece each transfer sent from here carries; per target rank held here,
    its device and how its piece is assembled from the transfers it receives (None: a 0-d piece,
    the one transfer's tensor). A transfer carries its named box of the tensor (``regions``: a
    head-tail reorder), or else the intersection of its two pieces; either lies in one box of each
    piece (``Layout.in_piece``)."""
    src, dst = step.src, step.dst
    regions = step.regions or tuple(intersect(src.box(t.src), dst.box(t.dst)) for t in step.transfers)
    sends = {i: _cuts(src.in_piece(t.src, regions[i]), src.piece_shape(t.src))
             for i, t in enumerate(step.transfers) if world.holds(t.src)}
    receives = {}
    for r in dst.placement.rank_list():
        if world.holds(r):
            shape = dst.piece_shape(r)
            mine = [i for i, t in enumerate(step.transfers) if t.dst == r]
            how = (shape, tuple(_cuts(dst.in_piece(r, regions[i]), shape) for i in mine)) if shape else None
            receives[r] = (world.device(dst.placement.type, r), mine, how)
    return sends, receives


def _send_recv(step: Step, meta, pieces, world):
    sends, receives = meta
    payload = {i: narrowed(pieces[step.transfers[i].src], c) for i, c in sends.items()}
    got = world.send_recv(step.transfers, payload, step.src.dtype, step.src.placement.type)
    out = {}
    for r, (device, mine, how) in receives.items():
        parts = [got[i] for i in mine]
        if how is None:
            out[r] = parts[0].to(device, copy=True)
            continue
        out[r], places = tile_places(how, step.dst.dtype, device)
        for place, part in zip(places, parts):
            if place is not None:
                place.copy_(part)
    return out


def _prepare_refactor(step: Step, world: World) -> dict:
    return {r: step.dst.piece_shape(r) for r in step.src.placement.rank_list() if world.holds(r)}


def _refactor(step: Step, shapes, pieces, world):
    return {r: t.reshape(shapes[r]) for r, t in pieces.items()}


_RUNNERS = {            # op -> (prepare(step, world) -> meta, run(step, meta, pieces, world) -> pieces)
    "all_gather": (_prepare_all_gather, _all_gather),
    "reduce_scatter": (_prepare_reduce_scatter, _reduce_scatter),
    "all_reduce": (_groups, _all_reduce),
    "all_to_all": (_prepare_all_to_all, _all_to_all),
    "slice": (_prepare_slice, _slice),
    "to_partial": (_prepare_to_partial, _to_partial),
    "copy": (_no_meta, _copy),
    "broadcast": (_no_meta, _broadcast),
    "send_recv": (_prepare_send_recv, _send_recv),
    "refactor": (_prepare_refactor, _refactor),
}
