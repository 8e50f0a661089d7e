"""The boxing executor: runs a plan's steps on a world, over the pieces this process holds.

Pieces are ``{rank: tensor}`` for the ranks of the layout's placement that live in this
process. Every rank walks the same steps and groups in the same order, so collectives are
issued identically everywhere; a rank outside a group skips it (still counting its bytes in
gt.comm_stats(), so every process counts every rank alike).
"""
from __future__ import annotations

import torch

from ..comm import profile_context as attribution
from ..comm.consistency import CHECK as _check, confirm_boxing
from ..comm.world import World
from .layout import intersect, relative, take
from .plan import Plan, Step


def execute(plan: Plan, pieces: dict, world: World) -> dict:
    if _check.enabled:
        confirm_boxing(plan, pieces, world)
    if attribution.on:                  # a comm_profile is open, or boxings are logged
        return attribution.within_boxing(plan, run_steps, pieces, world)
    return run_steps(plan, pieces, world)


def run_steps(plan: Plan, pieces: dict, world: World) -> dict:
    for step in plan.steps:
        if step.is_collective:
            world.prepare_groups(step.groups)
        pieces = _RUNNERS[step.op](step, pieces, world)
    return pieces


def _local(group, world):
    return [r for r in group if world.holds(r)]


def _skip(step: Step, group, world: World) -> None:
    """This process holds no rank of ``group``: count its collective all the same, so that every
    process's gt.comm_stats() sees every rank's bytes (the plan knows them from global meta)."""
    world.count(step.op, group, {r: b for r, b in step.bytes_per_rank if r in group})


def _alone(group, pieces, out) -> bool:
    """A group of one rank: its piece already is the result (one rank's S, B and P agree)."""
    if len(group) != 1:
        return False
    r = group[0]
    if r in pieces:
        out[r] = pieces[r].clone()
    return True


def _groups_here(step: Step, pieces, world, out):
    """``(group, the group's ranks held here)`` for each group that needs its collective run here;
    a group of one rank is settled into ``out``, one held nowhere here is only counted."""
    for g in step.groups:
        if _alone(g, pieces, out):
            continue
        mine = _local(g, world)
        if mine:
            yield g, mine
        else:
            _skip(step, g, world)


def _box_shape(box) -> tuple:
    return tuple(l for _, l in box)


def _all_gather(step: Step, pieces, world):
    if not step.axes:
        return _all_gather_across(step, pieces, world)
    dim = step.src.nd_sbp[step.axes[0]].dim
    out = {}
    for g, mine in _groups_here(step, pieces, world, out):
        sizes = [step.src.box(r)[dim][1] for r in g]
        full = _box_shape(step.dst.box(g[0]))
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


def _reduce_scatter(step: Step, pieces, world):
    dim = step.dst.nd_sbp[step.axes[0]].dim
    out = {}
    for g, mine in _groups_here(step, pieces, world, out):
        sizes = [step.dst.box(r)[dim][1] for r in g]
        out.update(world.reduce_scatter(g, {r: pieces[r] for r in mine}, dim, sizes))
    return out


def _all_reduce(step: Step, pieces, world):
    out = {}
    for g, mine in _groups_here(step, pieces, world, out):
        out.update(world.all_reduce(g, {r: pieces[r] for r in mine}))
    return out


def _all_to_all(step: Step, pieces, world):
    src, dst = step.src, step.dst
    out = {}
    for g, mine in _groups_here(step, pieces, world, out):
        blocks = [[intersect(src.box(s), dst.box(d)) for d in g] for s in g]
        zero = (0,) * len(src.shape)
        shapes = [[_box_shape(b) if b else zero for b in row] for row in blocks]
        chunks = {}
        for i, s in enumerate(g):
            if s in mine:
                sbox = src.box(s)
                chunks[s] = [take(pieces[s], relative(b, sbox)) if b else pieces[s].new_empty(shapes[i][j])
                             for j, b in enumerate(blocks[i])]
        received = world.all_to_all(g, chunks, shapes, src.dtype)
        for j, d in enumerate(g):
            if d in mine:
                out[d] = _assemble(dst.box(d), [(blocks[i][j], received[d][i]) for i in range(len(g))],
                                   dst.dtype, pieces[d].device)
    return out


def _assemble(box, parts, dtype, device) -> torch.Tensor:
    """A piece of ``box`` filled from ``(block box, tensor)`` parts that tile it."""
    whole = _back_to_back(box, parts, dtype, device)
    if whole is not None:
        return whole
    out = torch.empty(_box_shape(box), dtype=dtype, device=device)
    for b, t in parts:
        if b is not None and t.numel():
            take(out, relative(b, box)).copy_(t)
    return out


def _back_to_back(box, parts, dtype, device):
    """The piece as a view of the parts' buffer, when two or more parts are row blocks lying back to
    back in one storage (a process world's all-to-all receive buffer), else None.

    Parts that are views of source pieces (a simulated world hands them over as they are) are
    separate storages, so they never pass: a piece never aliases another tensor's piece.
    """
    filled = sorted(((b, t) for b, t in parts if b is not None and t.numel()), key=lambda bt: bt[0][0][0])
    if len(filled) < 2 or any(b[1:] != box[1:] for b, _ in filled):
        return None
    first = filled[0][1]
    storage = first.untyped_storage().data_ptr()
    ptr = first.data_ptr()
    for _, t in filled:
        if (not t.is_contiguous() or t.dtype != dtype or t.device != torch.device(device) or
                t.data_ptr() != ptr or t.untyped_storage().data_ptr() != storage):
            return None
        ptr += t.numel() * t.element_size()
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), _box_shape(box))


def _slice(step: Step, pieces, world):
    return {r: take(t, relative(step.dst.box(r), step.src.box(r))).clone() for r, t in pieces.items()}


def _to_partial(step: Step, pieces, world):
    """S->P: each rank pads its block with zeros; B->P: the group's first rank keeps the value."""
    x = step.src.nd_sbp[step.axes[0]]
    out = {}
    for g in step.groups:
        for i, r in enumerate(g):
            if not world.holds(r):
                continue
            t = pieces[r]
            if x.is_broadcast:
                out[r] = t.clone() if i == 0 else torch.zeros_like(t)
            else:
                dbox = step.dst.box(r)
                z = t.new_zeros(_box_shape(dbox))
                take(z, relative(step.src.box(r), dbox)).copy_(t)
                out[r] = z
    return out


def _copy(step: Step, pieces, world):
    device = lambda r: world.device(step.dst.placement.type, r)
    return {r: pieces[r].to(device(r), copy=True) for r in step.groups[0] if world.holds(r)}


def _broadcast(step: Step, pieces, world):
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


def _send_recv(step: Step, pieces, world):
    src, dst = step.src, step.dst
    payload = {i: take(pieces[t.src], relative(intersect(src.box(t.src), dst.box(t.dst)), src.box(t.src)))
               for i, t in enumerate(step.transfers) if world.holds(t.src)}
    got = world.send_recv(step.transfers, payload, src.dtype, src.placement.type)
    out = {}
    for r in dst.placement.rank_list():
        if not world.holds(r):
            continue
        box = dst.box(r)
        parts = [(intersect(src.box(t.src), box), got[i]) for i, t in enumerate(step.transfers) if t.dst == r]
        out[r] = _assemble(box, parts, dst.dtype, world.device(dst.placement.type, r)) if box else (
            parts[0][1].to(world.device(dst.placement.type, r), copy=True))
    return out


def _refactor(step: Step, pieces, world):
    return {r: t.reshape(step.dst.piece_shape(r)) for r, t in pieces.items()}


_RUNNERS = {
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "all_reduce": _all_reduce,
    "all_to_all": _all_to_all,
    "slice": _slice,
    "to_partial": _to_partial,
    "copy": _copy,
    "broadcast": _broadcast,
    "send_recv": _send_recv,
    "refactor": _refactor,
}
