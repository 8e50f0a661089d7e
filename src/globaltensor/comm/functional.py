"""A process world's collectives while ``torch.compile`` traces them: torch's functional collectives.

When an op on global tensors is traced (Dynamo / AOTAutograd hand the dispatcher fake pieces), the
process world's collectives cannot run ``torch.distributed``'s in-place calls on them; each becomes
its ``torch.distributed._functional_collectives`` form (the ``_c10d_functional`` ops), which returns
a new tensor and lands in the graph, where Inductor can reorder and overlap it. The results are
the pieces the eager collectives give: an uneven all-gather pads and cuts as the eager one does, a
reduce-scatter is an all-to-all of the parts and a sum (gloo has no reduce-scatter), an all-to-all
exchanges flattened blocks, and point-to-point transfers are one all-to-all over their peers (torch has
no functional send / recv).
"""
from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import is_fake

from ..sbp.shape import numel


# torch 2.13 deprecates all_gather_tensor (a warning on every call) for all_gather_single
_all_gather_single = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def traced(t: torch.Tensor) -> bool:
    """Whether ``t`` is a piece being traced: a fake tensor (tracing runs under a fake mode, so a
    piece made during it, the receiving side's buffer of a broadcast, is one too)."""
    return is_fake(t)


def tracing(tensors) -> bool:
    """Whether a collective of ``tensors`` is being traced: one of them is fake, or (a rank that only
    receives gives none) a fake mode is active."""
    return any(traced(t) for t in tensors) or detect_fake_mode() is not None


def _ranked(order: list) -> list:
    """Member positions in group-rank order."""
    return sorted(range(len(order)), key=order.__getitem__)


def all_gather(x: torch.Tensor, pg, order: list, dim: int, sizes: list) -> torch.Tensor:
    width = max(sizes)
    if x.shape[dim] < width:
        pad = list(x.shape)
        pad[dim] = width - x.shape[dim]
        x = torch.cat([x, x.new_zeros(pad)], dim=dim)
    gathered = _all_gather_single(x.contiguous(), dim, pg)
    blocks = torch.split(gathered, width, dim=dim)
    return torch.cat([blocks[order[i]].narrow(dim, 0, sizes[i]) for i in range(len(sizes))], dim=dim)


def exchange(blocks: list, received: list, pg, order: list) -> list:
    """Send ``blocks[j]`` to member j, receive a tensor of shape ``received[j]`` from each: one
    functional all-to-all of the flattened blocks, in group-rank order; the received in group order."""
    ranked = _ranked(order)
    send = torch.cat([blocks[j].reshape(-1) for j in ranked])
    recv_sizes = [numel(received[j]) for j in ranked]
    got = funcol.all_to_all_single(send, recv_sizes, [blocks[j].numel() for j in ranked], pg)
    parts = dict(zip(ranked, torch.split(got, recv_sizes)))
    return [parts[j].view(received[j]) for j in range(len(order))]


def reduce_scatter(x: torch.Tensor, pg, order: list, i_me: int, dim: int, sizes: list) -> torch.Tensor:
    parts = torch.split(x, list(sizes), dim=dim)
    shape = list(x.shape)
    shape[dim] = sizes[i_me]
    got = exchange(list(parts), [tuple(shape)] * len(sizes), pg, order)
    return torch.stack(got).sum(0)


def send_recv(transfers: list, payload: dict, dtype, device, me: int, group: tuple, pg, order: list) -> dict:
    """Point-to-point transfers as one functional all-to-all over ``group`` (every peer of the
    transfers): each member sends each other member its transfers to it, flattened in transfer
    order, and one padding element (gloo aborts an exchange in which a pair moves nothing; the
    padding also makes every exchange carry data both ways, so no rank's graph holds an exchange
    the others' do not). Returns ``{transfer index: received tensor}`` for the transfers into ``me``."""
    pad = torch.zeros(1, dtype=dtype, device=device)
    blocks, received, into = [], [], {}
    for j, peer in enumerate(group):
        mine = [payload[i].reshape(-1).to(dtype) for i, t in enumerate(transfers) if t.src == me and t.dst == peer]
        blocks.append(torch.cat(mine + [pad]) if peer != me else pad)
        theirs = [i for i, t in enumerate(transfers) if t.src == peer and t.dst == me and peer != me]
        into[j] = theirs
        received.append((sum(numel(transfers[i].shape) for i in theirs) + 1,))
    got = exchange(blocks, received, pg, order)
    out = {i: payload[i].to(device) for i, t in enumerate(transfers) if t.src == me and t.dst == me}
    for j, indices in into.items():
        offset = 0
        for i in indices:
            n = numel(transfers[i].shape)
            out[i] = got[j].narrow(0, offset, n).view(transfers[i].shape)
            offset += n
    return out


def all_reduce(x: torch.Tensor, pg) -> torch.Tensor:
    return funcol.all_reduce(x.contiguous(), "sum", pg)


def broadcast(x: torch.Tensor, src_group_rank: int, pg) -> torch.Tensor:
    return funcol.broadcast(x.contiguous(), src_group_rank, pg)
