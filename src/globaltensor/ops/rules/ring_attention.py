"""Ring attention: sdpa with q, k and v all split on the sequence, the output split the same way;
``is_causal``, an explicit mask (its query dim split like q, or broadcast there), or neither -- for
any kernel given as a block function (attention.py: the CPU op; attention_cuda_ring.py: the CUDA ones).

Each rank keeps its query rows and passes its key/value block around the ranks that split the
sequence: after ``W - 1`` steps every rank has attended to every block it may see. Each block's
partial output is merged into the running one by its log-sum-exp (``out = sum_j exp(lse_j - lse)
out_j``), so the result is exact; the logits never exist whole. Under ``is_causal`` (query ``i``
sees keys ``<= i``) a rank skips the keys wholly after its rows, runs the keys wholly before them
without a mask, and the square on its diagonal with the kernel's own ``is_causal``: no kernel takes
a mask of positions (CUDA's flash kernel takes none). An explicit mask holds the rank's query rows;
each block takes its key columns of it, and a row the mask hides wholly from a block takes nothing
from it.

The backward rotates the blocks again: each rank adds every block's share to its query gradient
(a kernel's backward, given the whole rows' output and log-sum-exp, gives each block's exact
share), and sends each block's key/value gradient shares back to the block's owner in one last
exchange, where they are summed.

The blocks move by point-to-point transfers (``World.send_recv``), counted like any collective;
the cost model counts them through the rule's ``kernel_bytes`` (attention_cost.py).
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
    """``(query range, key range, is_causal)`` of every block the kernel runs for ``rank``'s query rows
    and ``owner``'s key block: every pair of their ranges, and under the causal mask each pair cut
    into the keys wholly before the rows (no mask), a square on the diagonal (the kernel's own
    ``is_causal``: top-left and bottom-right alike), and the rows after that square (no mask) --
    so no kernel ever takes a mask of positions, and the keys wholly after the rows are skipped."""
    return [part for q in _rows(q_layout, rank) for k in _rows(k_layout, owner) if q[2] and k[2]
            for part in (_causal_parts(q, k) if causal else [(q, k, False)])]


def _causal_parts(q: tuple, k: tuple) -> list:
    """The blocks of one (query range, key range) pair under the causal mask (query ``i`` sees keys
    ``<= i``); rows before the first key see nothing of it and are in no block."""
    (r0, rp, n), (c0, cp, m) = q, k
    parts = []
    before = min(c0 + m, r0) - c0
    if before > 0:
        parts.append((q, (c0, cp, before), False))
    start = max(r0, c0)
    rows, cols = r0 + n - start, c0 + m - start
    if rows > 0 and cols > 0:
        side = min(rows, cols)
        diagonal_keys = (start, cp + start - c0, side)
        parts.append(((start, rp + start - r0, side), diagonal_keys, True))
        if rows > side:
            parts.append(((start + side, rp + start + side - r0, rows - side), diagonal_keys, False))
    return parts


def attention_work(q_layout: Layout, k_layout: Layout, causal: bool) -> Dict[int, int]:
    """``{rank: query-key scores}`` its ring attention computes per (batch, head), as the kernel runs
    it: a diagonal square its lower triangle, any other block all its rows x keys. Plain ``S(2)``
    under the causal mask gives the last rank ``2W - 1`` times the first's; head-tail gives every
    rank the same."""
    work = {}
    for group in axis_groups(q_layout.placement, tuple(seq_axes(q_layout))):
        for r in group:
            work[r] = sum(q[2] * (q[2] + 1) // 2 if diagonal else q[2] * k[2]
                          for owner in group for q, k, diagonal in _pairs(q_layout, k_layout, r, owner, causal))
    return work


def _mask_block(mask, rows: tuple, cols: tuple):
    """``(the explicit mask's block, rows it hides wholly or None)`` of one block; ``mask``: the mask's
    piece, holding the rank's query rows (or broadcast over them)."""
    if mask is None:
        return None, None
    rows_part = mask if mask.dim() < 2 or mask.shape[-2] == 1 else mask.narrow(-2, rows[1], rows[2])
    block = rows_part if rows_part.shape[-1] == 1 else rows_part.narrow(-1, cols[0], cols[2])
    return block, (block == -math.inf).all(-1)


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


def ring_forward(attend, pieces: dict, ins: List[Layout], causal: bool, scale) -> dict:
    """``{rank: (out, logsumexp [B, H, rows])}``: each held rank's query rows attended over every
    block, range by range of its rows (two for a head-tail split), merged by log-sum-exp in at least
    float32 (the caller casts to the op's dtypes). ``pieces``: ``{rank: {"query", "key", "value",
    "mask"}}``; ``attend(q, k, v, is_causal, mask, scale) -> (out, logsumexp [B, H, rows])``: the
    op's kernel on one block."""
    q_layout, k_layout, v_layout = ins[0], ins[1], ins[2]
    steps = _rotations(_groups(k_layout), k_layout, v_layout, {r: n["key"] for r, n in pieces.items()},
                       {r: n["value"] for r, n in pieces.items()})
    acc = {r: _empty_attention(n["query"], n["value"]) for r, n in pieces.items()}
    for step in steps:
        for r, (owner, k, v) in step.items():
            q = pieces[r]["query"]
            for rows, cols, diagonal in _pairs(q_layout, k_layout, r, owner, causal):
                block_mask, blind = _mask_block(pieces[r]["mask"], rows, cols)
                o, l = attend(_part(q, rows), _part(k, cols), _part(v, cols), diagonal, block_mask, scale)
                if blind is not None:
                    o = o.masked_fill(blind.unsqueeze(-1), 0.0)
                    l = l.masked_fill(blind, -math.inf)
                _merge_into(*acc[r], rows[1], o, l)
    return acc


def _empty_attention(q, value):
    """Rows that saw nothing yet: zero output, log-sum-exp -inf, in at least float32."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    return (q.new_zeros(q.shape[:-1] + (value.shape[-1],), dtype=dtype),
            q.new_full(q.shape[:-1], -math.inf, dtype=dtype))


def _merge_into(out, lse, at: int, o, l):
    """Merges one block's partial attention of rows ``at ..`` into the running one, by their log-sum-exps."""
    rows_out, rows_lse = out.narrow(2, at, o.shape[2]), lse.narrow(2, at, o.shape[2])
    total = torch.logaddexp(rows_lse, l.to(lse.dtype))
    keep, add = torch.exp(rows_lse - total).nan_to_num(0.0), torch.exp(l - total).nan_to_num(0.0)
    rows_out.copy_(rows_out * keep.unsqueeze(-1) + o * add.unsqueeze(-1))
    rows_lse.copy_(total)


def ring_backward(attend_backward, pieces: dict, ins: List[Layout], causal: bool, scale) -> dict:
    """``{rank: (grad_q, grad_k, grad_v)}``: every block's share of the query gradient, and each
    block's key/value gradient shares summed on the block's owner (in at least float32; sent in the
    key's dtype). ``pieces``: ring_forward's and ``"grad_out", "out", "logsumexp"`` (``[B, H,
    rows]``); ``attend_backward(grad_out, q, k, v, out, logsumexp, is_causal, mask, scale) ->
    (grad_q, grad_k, grad_v)`` of one block, given the whole rows' output and log-sum-exp (so each
    block's share is exact)."""
    q_layout, k_layout, v_layout = ins[1], ins[2], ins[3]
    world = get_world()
    steps = _rotations(_groups(k_layout), k_layout, v_layout, {r: n["key"] for r, n in pieces.items()},
                       {r: n["value"] for r, n in pieces.items()})
    dq = {r: _accumulator(n["query"]) for r, n in pieces.items()}
    shares: Dict[Tuple[int, int], tuple] = {}               # (rank, owner) -> (grad_k, grad_v) share
    for step in steps:
        for r, (owner, k, v) in step.items():
            n = pieces[r]
            for rows, cols, diagonal in _pairs(q_layout, k_layout, r, owner, causal):
                block_mask, _ = _mask_block(n["mask"], rows, cols)
                gq, gk, gv = attend_backward(_part(n["grad_out"], rows), _part(n["query"], rows), _part(k, cols),
                                             _part(v, cols), _part(n["out"], rows), _part(n["logsumexp"], rows),
                                             diagonal, block_mask, scale)
                _part(dq[r], rows).add_(gq)
                if (r, owner) not in shares:
                    shares[r, owner] = (_accumulator(k), _accumulator(v))
                _part(shares[r, owner][0], cols).add_(gk)
                _part(shares[r, owner][1], cols).add_(gv)
    dk = {r: _accumulator(n["key"]) for r, n in pieces.items()}
    dv = {r: _accumulator(n["value"]) for r, n in pieces.items()}
    transfers, payload, targets = [], {}, []
    for group in _groups(k_layout):
        for src in group:
            for owner in group:
                if owner == src or _skipped(q_layout, k_layout, src, owner, causal):
                    continue
                for which, layout in ((0, k_layout), (1, v_layout)):
                    if (src, owner) in shares:
                        payload[len(transfers)] = shares[src, owner][which].to(layout.dtype).contiguous()
                    transfers.append(Transfer(src, owner, layout.piece_shape(owner)))
                    targets.append((owner, which))
    for (r, owner), (gk, gv) in shares.items():
        if r == owner:
            dk[r], dv[r] = dk[r] + gk, dv[r] + gv
    if transfers:
        got = world.send_recv(transfers, payload, k_layout.dtype, k_layout.placement.type)
        for index, part in got.items():
            owner, which = targets[index]
            if which == 0:
                dk[owner] = dk[owner] + part
            else:
                dv[owner] = dv[owner] + part
    return {r: (dq[r].to(n["query"].dtype), dk[r].to(n["key"].dtype), dv[r].to(n["value"].dtype))
            for r, n in pieces.items()}


def _accumulator(t: torch.Tensor) -> torch.Tensor:
    """Zeros like ``t`` in at least float32: a low-precision gradient summed block by block keeps
    what one kernel call's float32 accumulation would."""
    return torch.zeros_like(t, dtype=torch.promote_types(t.dtype, torch.float32))


def _skipped(q_layout: Layout, k_layout: Layout, rank: int, owner: int, causal: bool) -> bool:
    """Whether ``rank``'s query rows see nothing of ``owner``'s key block (no compute, no gradient share)."""
    return not _pairs(q_layout, k_layout, rank, owner, causal)
