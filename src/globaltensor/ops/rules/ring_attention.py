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


def _rows(layout: Layout, rank: int) -> tuple:
    """``(start in the sequence, start in the piece, length)`` of each range of the sequence dim the
    rank holds: one for a plain split, two for a head-tail one (``S(2, order="head_tail")``)."""
    return layout.segments(rank, 2)


def _pairs(q_layout: Layout, k_layout: Layout, rank: int, owner: int, causal: bool) -> list:
    """``(query range, key range)`` of every pair of ``rank``'s query rows and ``owner``'s key block
    that attends: not empty and, under the causal mask, not wholly after the rows."""
    return [(q, k) for q in _rows(q_layout, rank) for k in _rows(k_layout, owner)
            if q[2] and k[2] and not (causal and k[0] > q[0] + q[2] - 1)]


def attention_work(q_layout: Layout, k_layout: Layout, causal: bool) -> Dict[int, int]:
    """``{rank: query-key scores}`` its ring attention computes per (batch, head), as the kernel runs
    it: a pair of ranges starting together under the causal mask is the kernel's ``is_causal`` (its
    lower triangle), any other kept pair all its rows x keys. Plain ``S(2)`` under the causal mask
    gives the last rank ``2W - 1`` times the first's; head-tail gives every rank the same."""
    work = {}
    for group in axis_groups(q_layout.placement, tuple(seq_axes(q_layout))):
        for r in group:
            work[r] = sum(q[2] * (q[2] + 1) // 2 if causal and q[0] == k[0] else q[2] * k[2]
                          for owner in group for q, k in _pairs(q_layout, k_layout, r, owner, causal))
    return work


def _block_mask(q_rows, k_cols, causal, like, mask=None):
    """``(additive mask or None, rows that see nothing or None, is_causal)`` of one (query range, key
    range) pair that :func:`_pairs` keeps (``(start, _, length)`` each); ``mask``: the explicit mask's
    piece, holding the rank's query rows. A key range starting at the rows' first position (the
    rank's own chunk) is the kernel's own ``is_causal`` -- no mask of rows x keys is made."""
    (r0, p0, n), (c0, _, m) = q_rows, k_cols
    if mask is not None:
        rows = mask if mask.dim() < 2 or mask.shape[-2] == 1 else mask.narrow(-2, p0, n)
        block = rows if rows.shape[-1] == 1 else rows.narrow(-1, c0, m)
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


def _part(t: torch.Tensor, where: tuple) -> torch.Tensor:
    """The piece's part along the sequence dim at ``(_, start in the piece, length)``."""
    return t if where[1] == 0 and where[2] == t.shape[2] else t.narrow(2, where[1], where[2])


def ring_forward(func, n_by_rank: dict, ins: List[Layout], causal: bool, scale) -> dict:
    """``{rank: (out, logsumexp)}``: each held rank's query rows attended over every block, range by
    range of its rows (two for a head-tail split), merged by log-sum-exp."""
    q_layout, k_layout, v_layout = ins[0], ins[1], ins[2]
    qs = {r: n["query"] for r, n in n_by_rank.items()}
    steps = _rotations(_groups(k_layout), k_layout, v_layout, {r: n["key"] for r, n in n_by_rank.items()},
                       {r: n["value"] for r, n in n_by_rank.items()})
    merged: Dict[Tuple[int, int], tuple] = {}          # (rank, query range's piece start) -> (out, lse)
    for step in steps:
        for r, (owner, k, v) in step.items():
            for rows, cols in _pairs(q_layout, k_layout, r, owner, causal):
                q = _part(qs[r], rows)
                block_mask, blind, own = _block_mask(rows, cols, causal, q, n_by_rank[r]["attn_mask"])
                o, l = func(q, _part(k, cols), _part(v, cols), 0.0, own, attn_mask=block_mask, scale=scale)
                if blind is not None:
                    o = o.masked_fill(blind.unsqueeze(-1), 0.0)
                    l = l.masked_fill(blind, -math.inf)
                key = (r, rows[1])
                merged[key] = (o, l) if key not in merged else _merge(*merged[key], o, l)
    out = {}
    for r, q in qs.items():
        parts = [merged.get((r, rows[1])) or _nothing_seen(_part(q, rows), n_by_rank[r]["value"])
                 for rows in _rows(q_layout, r) if rows[2]] or [_nothing_seen(q, n_by_rank[r]["value"])]
        out[r] = (parts[0] if len(parts) == 1 else
                  (torch.cat([o for o, _ in parts], 2), torch.cat([l for _, l in parts], 2)))
    return out


def _merge(out, lse, o, l):
    """Two partial attentions of the same rows merged by their log-sum-exps."""
    total = torch.logaddexp(lse, l)
    keep, add = torch.exp(lse - total), torch.exp(l - total)
    return (out * keep.nan_to_num(0.0).unsqueeze(-1).to(o.dtype) + o * add.nan_to_num(0.0).unsqueeze(-1).to(o.dtype),
            total)


def _nothing_seen(q, value):
    """Rows that saw no block (no keys before them, or no rows): zero output, log-sum-exp -inf."""
    return q.new_zeros(q.shape[:-1] + (value.shape[-1],)), q.new_full(q.shape[:-1], -math.inf)


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
            n = n_by_rank[r]
            for rows, cols in _pairs(q_layout, k_layout, r, owner, causal):
                block_mask, _, own = _block_mask(rows, cols, causal, n["query"], n["attn_mask"])
                gq, gk, gv = func(_part(n["grad_out"], rows), _part(n["query"], rows), _part(k, cols),
                                  _part(v, cols), _part(n["out"], rows), _part(n["logsumexp"], rows), 0.0, own,
                                  attn_mask=block_mask, scale=scale)
                _part(dq[r], rows).add_(gq)
                if (r, owner) not in shares:
                    shares[r, owner] = (torch.zeros_like(k), torch.zeros_like(v))
                _part(shares[r, owner][0], cols).add_(gk)
                _part(shares[r, owner][1], cols).add_(gv)
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
    """Whether ``rank``'s query rows see nothing of ``owner``'s key block (no compute, no gradient share)."""
    return not _pairs(q_layout, k_layout, rank, owner, causal)
