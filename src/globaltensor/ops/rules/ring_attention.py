"""Ring attention: sdpa with q, k and v all split on the sequence, the output split the same way;
``is_causal``, an explicit mask (its query dim split like q, or broadcast there), or neither.

Each rank keeps its query rows and passes its key/value block around the ranks that split the
sequence: after ``W - 1`` steps every rank has attended to every block it may see. Each step's
partial output is merged into the running one by its log-sum-exp (``out = sum_j exp(lse_j - lse)
out_j``), so the result is exact; the logits never exist whole. Under ``is_causal`` (query ``i``
sees keys ``<= i``) a rank skips the blocks wholly after its rows, runs the blocks wholly before
them without a mask, and the block on its diagonal with one. An explicit mask holds the rank's
query rows; each block takes its key columns of it, and a row the mask hides wholly from a block
takes nothing from it.

The backward rotates the blocks again: each rank adds every block's share to its query gradient
(the CPU kernel's backward, given the global output and log-sum-exp, gives each block's exact
share), and sends each block's key/value gradient shares back to the block's owner in one last
exchange, where they are summed.

The blocks move by point-to-point transfers (``World.send_recv``), counted like any collective;
the cost model counts them through the rule's ``kernel_bytes`` (attention.py).
"""
from __future__ import annotations

import math
from typing import Dict, List, Tuple

import torch

from ...boxing import Layout
from ...boxing.layout import axis_groups
from ...comm import Transfer, get_world


def seq_axes(layout: Layout) -> List[int]:
    """The placement axes that split the sequence dim (2) of a ``[B, H, L, E]`` layout."""
    return [a for a, v in enumerate(layout.nd_sbp) if v.is_split and v.dim == 2]


def ring_bytes(key: Layout, value: Layout, backward: bool) -> int:
    """The most bytes a rank sends: the key and value blocks it passes on (every block but the next
    member's), and in the backward also its gradient share of every other member's block."""
    world_groups = axis_groups(key.placement, tuple(seq_axes(key)))
    most = 0
    for group in world_groups:
        width = len(group)
        block = [key.piece_bytes(r) + value.piece_bytes(r) for r in group]
        for i in range(width):
            sent = sum(block[(i - s) % width] for s in range(width - 1))
            if backward:
                sent += sum(block[j] for j in range(width) if j != i)
            most = max(most, sent)
    return most


def _rows(layout: Layout, rank: int) -> Tuple[int, int]:
    return layout.box(rank)[2]


def _block_mask(q_rows, k_cols, causal, like, mask=None):
    """``(additive mask or None, rows that see nothing or None, is_causal)`` of one (query rows, key
    block) pair that :func:`_skipped` keeps; ``mask``: the explicit mask's piece, holding the rank's
    query rows. A block starting at the rows' first position (a rank's own block) is the kernel's
    own ``is_causal`` -- no mask of rows x keys is made."""
    (r0, n), (c0, m) = q_rows, k_cols
    if mask is not None:
        block = mask if mask.shape[-1] == 1 else mask.narrow(-1, c0, m)
        return block, (block == -math.inf).all(-1), False
    if not causal or c0 + m - 1 <= r0:
        return None, None, False
    if c0 == r0:
        return None, None, True
    rows = torch.arange(r0, r0 + n, device=like.device).unsqueeze(1)
    cols = torch.arange(c0, c0 + m, device=like.device).unsqueeze(0)
    additive = torch.where(cols <= rows, torch.zeros((), dtype=like.dtype, device=like.device),
                           torch.full((), -math.inf, dtype=like.dtype, device=like.device))
    blind = min(max(c0 - r0, 0), n)       # rows before the block's first key see none of it: from the ranges,
    return additive, (torch.arange(n, device=like.device) < blind) if blind else None, False   # no host read


def _rotations(groups, key_layout: Layout, value_layout: Layout, keys: Dict[int, torch.Tensor],
               values: Dict[int, torch.Tensor]):
    """Yields, for each step ``s`` (0 .. W - 1), ``{rank: (owner, key block, value block)}`` of the held
    ranks, the blocks passed one member on per step (``send_recv``, both tensors in one exchange).
    A generator: a step's blocks are received once the previous step's are used, so a rank holds
    one block of k and v (and the one arriving) at a time, never the whole sequence's."""
    world = get_world()
    held = {r: (r, keys[r], values[r]) for r in keys}
    width = len(groups[0])
    dtype = next(iter(keys.values())).dtype
    for step in range(1, width):
        yield held
        transfers, payload, sources = [], {}, []
        for group in groups:
            for i, src in enumerate(group):
                dst = group[(i + 1) % width]
                owner = group[(i - step + 1) % width]
                for which, layout in ((1, key_layout), (2, value_layout)):
                    if src in held:
                        payload[len(transfers)] = held[src][which]
                    transfers.append(Transfer(src, dst, layout.piece_shape(owner)))
                    sources.append((dst, owner, which))
        got = world.send_recv(transfers, payload, dtype, key_layout.placement.type)
        moved: Dict[int, list] = {}
        for index, (dst, owner, which) in enumerate(sources):
            if index in got:
                moved.setdefault(dst, [owner, None, None])[which] = got[index]
        held = {r: tuple(v) for r, v in moved.items()}
    yield held


def _groups(layout: Layout) -> list:
    world = get_world()
    return [g for g in axis_groups(layout.placement, tuple(seq_axes(layout))) if any(world.holds(r) for r in g)]


def ring_forward(func, n_by_rank: dict, ins: List[Layout], causal: bool, scale) -> dict:
    """``{rank: (out, logsumexp)}``: each held rank's query rows attended over every block."""
    q_layout, k_layout, v_layout = ins[0], ins[1], ins[2]
    qs = {r: n["query"] for r, n in n_by_rank.items()}
    steps = _rotations(_groups(k_layout), k_layout, v_layout, {r: n["key"] for r, n in n_by_rank.items()},
                       {r: n["value"] for r, n in n_by_rank.items()})
    out: Dict[int, torch.Tensor] = {}
    lse: Dict[int, torch.Tensor] = {}
    for step in steps:
        for r, (owner, k, v) in step.items():
            if _skipped(q_layout, k_layout, r, owner, causal):
                continue
            q = qs[r]
            block_mask, blind, own = _block_mask(_rows(q_layout, r), _rows(k_layout, owner), causal, q,
                                                 n_by_rank[r]["attn_mask"])
            o, l = func(q, k, v, 0.0, own, attn_mask=block_mask, scale=scale)
            if blind is not None:
                o = o.masked_fill(blind.unsqueeze(-1), 0.0)
                l = l.masked_fill(blind, -math.inf)
            if r not in out:
                out[r], lse[r] = o, l
                continue
            total = torch.logaddexp(lse[r], l)
            keep, add = torch.exp(lse[r] - total), torch.exp(l - total)
            out[r] = out[r] * keep.nan_to_num(0.0).unsqueeze(-1).to(o.dtype) + \
                o * add.nan_to_num(0.0).unsqueeze(-1).to(o.dtype)
            lse[r] = total
    for r, q in qs.items():                    # no block seen (no query rows here)
        if r not in out:
            out[r] = q.new_zeros(q.shape[:-1] + (n_by_rank[r]["value"].shape[-1],))
            lse[r] = q.new_full(q.shape[:-1], -math.inf)
    return {r: (out[r], lse[r]) for r in qs}


def ring_backward(func, n_by_rank: dict, ins: List[Layout], causal: bool, scale) -> dict:
    """``{rank: (grad_q, grad_k, grad_v)}``: every block's share of the query gradient, and each
    block's key/value gradient shares summed on the block's owner."""
    q_layout, k_layout, v_layout = ins[1], ins[2], ins[3]
    world = get_world()
    steps = _rotations(_groups(k_layout), k_layout, v_layout, {r: n["key"] for r, n in n_by_rank.items()},
                       {r: n["value"] for r, n in n_by_rank.items()})
    dq = {r: torch.zeros_like(n["query"]) for r, n in n_by_rank.items()}
    shares: Dict[Tuple[int, int], tuple] = {}               # (rank, owner) -> (grad_k, grad_v) share
    for step in steps:
        for r, (owner, k, v) in step.items():
            if _skipped(q_layout, k_layout, r, owner, causal):
                continue
            n = n_by_rank[r]
            block_mask, _, own = _block_mask(_rows(q_layout, r), _rows(k_layout, owner), causal, n["query"],
                                             n["attn_mask"])
            gq, gk, gv = func(n["grad_out"], n["query"], k, v, n["out"], n["logsumexp"], 0.0, own,
                              attn_mask=block_mask, scale=scale)
            dq[r] = dq[r] + gq
            shares[r, owner] = (gk, gv)
    dk = {r: torch.zeros_like(n["key"]) for r, n in n_by_rank.items()}
    dv = {r: torch.zeros_like(n["value"]) for r, n in n_by_rank.items()}
    transfers, payload, targets = [], {}, []
    for group in _groups(k_layout):
        for src in group:
            for owner in group:
                if owner == src or _skipped(q_layout, k_layout, src, owner, causal):
                    continue
                for which, layout in ((0, k_layout), (1, v_layout)):
                    if (src, owner) in shares:
                        payload[len(transfers)] = shares[src, owner][which].contiguous()
                    transfers.append(Transfer(src, owner, layout.piece_shape(owner)))
                    targets.append((owner, which))
    for (r, owner), (gk, gv) in shares.items():
        if r == owner:
            dk[r], dv[r] = dk[r] + gk, dv[r] + gv
    if transfers:
        sample = next(iter(n_by_rank.values()))["key"]
        got = world.send_recv(transfers, payload, sample.dtype, k_layout.placement.type)
        for index, part in got.items():
            owner, which = targets[index]
            if which == 0:
                dk[owner] = dk[owner] + part
            else:
                dv[owner] = dv[owner] + part
    return {r: (dq[r], dk[r], dv[r]) for r in n_by_rank}


def _skipped(q_layout: Layout, k_layout: Layout, rank: int, owner: int, causal: bool) -> bool:
    """Whether ``rank``'s query rows see nothing of ``owner``'s key block: an empty piece, or, under the
    causal mask, a block wholly after the rows (skipped: no compute, no gradient share)."""
    (r0, n), (c0, m) = _rows(q_layout, rank), _rows(k_layout, owner)
    return n == 0 or m == 0 or (causal and c0 > r0 + n - 1)
