"""A local tensor made global: ``to_global`` of a rank's piece (split pieces concatenated, broadcast
replicas taken as equal, partial pieces summed), ``distribute`` of the whole logical tensor, and
the drop-in ``torch.Tensor.to_global``.

A split piece's logical shape is exchanged with one small collective (a process world) or follows
from the piece (a simulated world, where the local tensor is every rank's piece).
"""
from __future__ import annotations

from typing import Optional

import torch

from .comm import Transfer, get_world
from .placement import Placement
from .sbp import as_nd_sbp, check_blocks
from .sbp.shape import piece_shape
from .boxing import Layout
from .compat.dynamo import trace_through
from .tensor import GlobalTensor, check_placement, box_like, gradient_layout, replicate


class _MetaReads:
    depth = 0


def reading_meta() -> bool:
    """Whether the host is reading shapes, not values (the shape exchange of ``to_global``): a captured
    graph may freeze these, as they follow from the argument metas."""
    return _MetaReads.depth > 0


class meta_read:
    """While inside, the host reads shapes, not values (see :func:`reading_meta`)."""

    def __enter__(self):
        _MetaReads.depth += 1

    def __exit__(self, *exc):
        _MetaReads.depth -= 1


def _global_shape_from_pieces(local: torch.Tensor, placement: Placement, nd: tuple) -> tuple:
    """The logical shape from this rank's piece: exchanged with one small collective when split."""
    with meta_read():
        return _exchanged_shape(local, placement, nd)


def _exchanged_shape(local: torch.Tensor, placement: Placement, nd: tuple) -> tuple:
    world = get_world()
    split_axes = [a for a, v in enumerate(nd) if v.is_split]
    if not split_axes:
        return tuple(local.shape)
    if world.simulated:
        shape = list(local.shape)
        for a in split_axes:
            shape[nd[a].dim] *= placement.hierarchy[a]
        return tuple(shape)
    everyone = tuple(range(world.size))  # ranks outside the placement need the shape too
    shapes = exchange_shapes(local, everyone)
    return logical_shape({r: shapes[r] for r in placement.rank_list()}, placement, nd, "to_global")


def exchange_shapes(local: torch.Tensor, group: tuple) -> dict:
    """``{rank: shape}`` of every member's ``local`` (a process world; only the members call it).

    One small all-gather over the whole world; over fewer ranks, point-to-point messages, which
    need no process group (creating one would take every process of the world)."""
    world = get_world()
    mine = torch.tensor(list(local.shape), dtype=torch.int64)
    if tuple(sorted(group)) == tuple(range(world.size)):
        gathered = world.all_gather(group, {world.rank: mine.view(1, -1)}, 0, [1] * len(group),
                                    (len(group), local.dim()), torch.int64)[world.rank]
        return {r: tuple(int(v) for v in gathered[i]) for i, r in enumerate(group)}
    transfers = [Transfer(src, dst, (local.dim(),)) for src in group for dst in group if src != dst]
    got = world.send_recv(transfers, {i: mine for i, t in enumerate(transfers) if t.src == world.rank},
                          torch.int64, "cpu")
    shapes = {transfers[i].src: tuple(int(v) for v in t) for i, t in got.items()}
    shapes[world.rank] = tuple(local.shape)
    return {r: shapes[r] for r in group}


def logical_shape(shapes: dict, placement: Placement, nd: tuple, name: str) -> tuple:
    """The logical shape whose pieces under ``nd`` have ``shapes`` (``{rank: shape}``, every rank of
    the placement); ValueError (naming ``name``) when they are not the balanced split of one."""
    split_axes = [a for a, v in enumerate(nd) if v.is_split]
    shape = list(shapes[placement.rank_list()[0]])
    for d in {nd[a].dim for a in split_axes}:
        axes = [a for a in split_axes if nd[a].dim == d]
        shape[d] = sum(s[d] for r, s in shapes.items()
                       if all(placement.coord(r)[b] == 0 for b in range(placement.ndim) if b not in axes))
    for r, s in shapes.items():
        expected = piece_shape(tuple(shape), placement.hierarchy, nd, placement.coord(r))
        if s != expected:
            raise ValueError(f"{name}: rank {r}'s local tensor has shape {s}, but {nd} of the logical shape "
                             f"{tuple(shape)} gives it {expected}; pieces must follow the balanced split")
    return tuple(shape)


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, layout, pieces):
        ctx.layout = layout
        return GlobalTensor(layout, pieces)

    @staticmethod
    def backward(ctx, grad):
        g = box_like(grad, gradient_layout(ctx.layout))
        return g._pieces.get(get_world().local_ranks[0], torch.zeros(0)), None, None


@trace_through
def to_global(t: torch.Tensor, placement: Optional[Placement] = None, sbp=None, *, shape=None,
              grad_sbp=None) -> GlobalTensor:
    """A local tensor as this rank's piece of a global tensor, or a global tensor boxed to a new layout.

    From a local tensor: split pieces are concatenated, broadcast replicas taken as equal,
    partial pieces summed. In a simulated world the local tensor is every rank's piece.
    """
    if isinstance(t, GlobalTensor):
        return t.to_global(placement, sbp, grad_sbp=grad_sbp)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"to_global: expected a torch.Tensor, got {type(t).__name__}")
    if placement is None or sbp is None:
        raise ValueError("to_global: a local tensor needs both placement= and sbp=")
    placement = check_placement(placement)
    nd = as_nd_sbp(sbp, placement.ndim, t.dim(), "to_global(sbp)")
    _check_device(t, placement)
    if shape is None:
        shape = _global_shape_from_pieces(t, placement, nd)
    check_blocks(shape, placement.hierarchy, nd, "to_global(sbp)")
    layout = Layout(tuple(shape), t.dtype, placement, nd)
    world = get_world()
    held = [r for r in placement.rank_list() if world.holds(r)]
    pieces = {r: (t if i == 0 else t.clone()) for i, r in enumerate(held)}
    for r in held:
        if tuple(pieces[r].shape) != layout.piece_shape(r):
            raise ValueError(f"to_global: rank {r}'s local tensor has shape {tuple(pieces[r].shape)}, "
                             f"expected {layout.piece_shape(r)} for {nd} of shape {tuple(shape)}")
    return _FromLocal.apply(t, layout, pieces)


def _check_device(t: torch.Tensor, placement: Placement) -> None:
    if t.device.type != placement.type:
        raise ValueError(f"to_global: the local tensor is on {t.device.type}, the placement is {placement.type}; "
                         f"move it with .to('{placement.type}') first")


@trace_through
def distribute(t: torch.Tensor, placement: Placement, sbp) -> GlobalTensor:
    """``t`` is the whole logical tensor (equal on every rank); each rank keeps its own slice.

    The result is a new leaf with ``t``'s ``requires_grad``, as DTensor's ``distribute_tensor`` gives:
    its ``.grad`` fills in the backward (``x.to_global(...)`` is the differentiable form, whose
    gradient reaches ``t``). It owns its memory, as ``torch.tensor`` does: writing into it leaves
    ``t`` alone (a piece that would be ``t`` itself or a slice of it is copied; only those are)."""
    if not isinstance(t, torch.Tensor) or isinstance(t, GlobalTensor):
        raise TypeError(f"distribute: expected a plain torch.Tensor, got {type(t).__name__}")
    placement = check_placement(placement)
    nd = as_nd_sbp(sbp, placement.ndim, t.dim(), "distribute(sbp)")
    source = t.detach()
    if source.device.type != placement.type:
        source = source.to(get_world().device(placement.type, get_world().local_ranks[0]))
    with torch.no_grad():
        out = replicate(source, placement).to_global(placement, nd)
    storage = source.untyped_storage().data_ptr()
    for r, piece in out._pieces.items():
        if piece.numel() and piece.untyped_storage().data_ptr() == storage:
            out._pieces[r] = piece.clone()
    return out.requires_grad_(t.requires_grad) if t.requires_grad else out


def install_tensor_methods() -> None:
    """The drop-in form: ``torch.Tensor.to_global`` and ``is_global`` on plain tensors."""
    if not hasattr(torch.Tensor, "is_global") or not isinstance(getattr(torch.Tensor, "is_global"), property):
        torch.Tensor.is_global = property(lambda self: False)

    def tensor_to_global(self, placement=None, sbp=None, **kwargs):
        return to_global(self, placement, sbp, **kwargs)

    torch.Tensor.to_global = trace_through(tensor_to_global)
