"""Run :func:`~.chunk_layout.repartition_moves`: pieces cut one way become pieces cut the other way.

Only the rows whose owner changes travel (one batch of point-to-point sends, counted in
``gt.comm_stats()`` like any boxing); a rank whose block is unchanged keeps its piece itself,
storage included.
"""
from __future__ import annotations

import torch

from ..comm import get_world
from ..comm.world import Transfer
from .chunk_layout import layouts_agree, piece_box, repartition_moves


def _narrow(t: torch.Tensor, region: tuple, box: tuple) -> torch.Tensor:
    """The part of ``t`` (the piece holding ``box``) that lies in ``region``, as a view."""
    for d, ((start, length), (box_start, _)) in enumerate(zip(region, box)):
        t = t.narrow(d, start - box_start, length)
    return t


def repartition(pieces: dict, shape: tuple, dtype: torch.dtype, placement, nd_sbp: tuple,
                src_style: str, dst_style: str) -> dict:
    """``{rank: piece}`` cut in ``src_style`` (``"balanced"`` or ``"chunk"``) -> the same logical tensor
    cut in ``dst_style``, for the ranks of ``placement`` held here. Every rank of the placement calls it."""
    hierarchy = placement.hierarchy
    if layouts_agree(shape, hierarchy, nd_sbp):
        return dict(pieces)
    world = get_world()
    moves = repartition_moves(shape, hierarchy, nd_sbp, src_style, dst_style)
    rank_at = {c: int(placement.ranks[c]) for c in {m.src for m in moves} | {m.dst for m in moves}}
    transfers, payload = [], {}
    for i, m in enumerate(moves):
        src = rank_at[m.src]
        transfers.append(Transfer(src, rank_at[m.dst], tuple(l for _, l in m.region)))
        if world.holds(src):
            payload[i] = _narrow(pieces[src], m.region, piece_box(shape, hierarchy, nd_sbp, m.src, src_style))
    received = world.send_recv(transfers, payload, dtype, placement.type)
    out = {}
    for rank in pieces:
        coord = placement.coord(rank)
        box = piece_box(shape, hierarchy, nd_sbp, coord, dst_style)
        mine = [i for i, m in enumerate(moves) if m.dst == coord]
        if box == piece_box(shape, hierarchy, nd_sbp, coord, src_style) and [moves[i].src for i in mine] == [coord]:
            out[rank] = pieces[rank]          # unchanged block: the piece itself
            continue
        piece = torch.empty(tuple(l for _, l in box), dtype=dtype, device=world.device(placement.type, rank))
        for i in mine:
            _narrow(piece, moves[i].region, box).copy_(received[i])
        out[rank] = piece
    return out


class Repartition(torch.autograd.Function):
    """:func:`repartition` of this process's one piece, differentiable: the gradient moves back."""

    @staticmethod
    def forward(ctx, local, shape, placement, nd_sbp, src_style, dst_style):
        ctx.meta = (shape, placement, nd_sbp, src_style, dst_style)
        rank = get_world().local_ranks[0]
        if rank not in placement.rank_list():
            return local
        return repartition({rank: local}, shape, local.dtype, placement, nd_sbp, src_style, dst_style)[rank]

    @staticmethod
    def backward(ctx, grad):
        shape, placement, nd_sbp, src_style, dst_style = ctx.meta
        rank = get_world().local_ranks[0]
        if rank in placement.rank_list():
            grad = repartition({rank: grad.contiguous()}, shape, grad.dtype, placement, nd_sbp,
                               dst_style, src_style)[rank]
        return grad, None, None, None, None, None
