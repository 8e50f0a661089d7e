"""Losses: ``nll_loss`` / ``nll_loss2d`` (what ``F.cross_entropy`` and ``F.nll_loss`` reach after
``_log_softmax``), the class dim split included (*loss parallelism*).

``nll_loss_forward(x [N, C], target [N], weight [C]?, reduction, ignore_index) -> (output, total_weight)``
and ``nll_loss2d_forward`` (``x [N, C, H, W]``, ``target [N, H, W]``, the same otherwise; 3-D
``cross_entropy`` inputs reach it as views with ``W = 1``). ``output`` is ``-w[t] * x[.., t, ..]``
per row ("none"), their sum ("sum"), or their sum over ``total_weight`` = the sum of ``w[t]``
over the rows not ignored ("mean"); ``total_weight`` is 0 for "none". Candidates, one axis:

- a batch (non-class) dim ``d`` of ``x`` split with the matching dim of ``target``:
  "none" ``S(d), S(d') -> S(d'), B``; "sum" ``-> P, P`` (both sums split by rows).
  "mean" needs the *global* ``total_weight``, which no rank can count from its own rows; it
  takes the whole ``target`` instead (``S(d), B -> P, B``): each rank sums its own rows and
  divides by the total weight it counts over every target (moving the N targets, never the
  N x C input).
- the class dim split (``S(1)``, target ``B``): each rank holds classes ``[c0, c0 + m)`` and picks
  only the targets in its range, shifted by ``-c0``; the others become ``ignore_index`` for the
  local op, so they give 0 and are not counted. Every target lies in exactly one rank's range,
  so output and (for "sum") total_weight are partial sums: ``S(1), B -> P, P`` ("none":
  ``-> P, B``; "mean": ``-> P, B`` as above). The weight (C numbers) stays whole: a weight
  split with the classes would not line up with nested class splits (``(S(1), S(1))``).
- ``x`` partial: the loss is linear in ``x``: ``P, B -> P, B``.

These are not the plain op on the pieces (targets shifted and masked, the mean divided by the
global weight), so the forward runs through a ``kernel``; it reads each rank's row and class
ranges from the rank's box of ``x``'s layout, so every nd-SBP (``(S(0), S(1))`` too) is right.
Nothing here communicates: the only traffic is the boxing the chosen candidate asks for.

``nll_loss_backward(grad_output, x, target, weight?, reduction, ignore_index, total_weight)``
(and ``nll_loss2d_backward``) gives ``grad_input`` in ``x``'s layout: ``-w[t] * g`` (``/ total_weight``
for "mean") at each row's target. ``x`` is only read for its shape. Batch split:
``g, S(d), S(d'), [B], tw -> S(d)`` (``g`` is ``S(d')`` for "none", else ``B``); class split:
``B, S(1), B, [B], tw -> S(1)`` with the same target shift through ``local``; partial
``g``: ``P, B, B, [B], tw -> P``. ``total_weight`` must be the global one (``B``) for "mean";
"sum" and "none" do not read it, so there it is taken as ``P``, which every layout boxes to
without moving a byte (the forward of "sum" leaves it partial).

Loss parallel: ``F.cross_entropy(logits, target)`` with the logits split along the classes is
``_log_softmax`` over the split dim -- exact without moving the logits, see softmax.py -- then
``nll_loss_forward`` with the class split as above.
"""
from __future__ import annotations

import torch

from ...boxing import Layout
from ...sbp import Split
from ...tensor import GlobalTensor, box
from ..registry import aten, register_rule
from .common import B, P, S, bind, call_args, sig

NONE, MEAN, SUM = 0, 1, 2
_LOCAL_IGNORE = -100   # the ignore_index of a rank's own call: never one of its (shifted) classes






# -- nll_loss ---------------------------------------------------------------------------------

def _row_dims(x) -> list:
    """``(x dim, target dim)`` for each non-class dim: x is [N, C, *rest], target [N, *rest]."""
    return [(0, 0)] + [(d, d - 1) for d in range(2, x.dim())]


def _nll_forward_candidates(x, target, weight=None, reduction=MEAN, ignore_index=-100):
    if x.dim() < 2:
        return []
    w = [] if weight is None else [B]
    cands = []
    for d, td in _row_dims(x):
        if reduction == NONE:
            cands.append(sig([S(d), S(td)] + w, [S(td), B]))
        elif reduction == SUM:
            cands.append(sig([S(d), S(td)] + w, [P, P]))
        else:
            cands.append(sig([S(d), S(td)] + w, [P, B]))
            cands.append(sig([S(d), B] + w, [P, B]))
    outs = {NONE: [P, B], SUM: [P, P], MEAN: [P, B]}[reduction]
    cands.append(sig([S(1), B] + w, outs))
    cands.append(sig([P, B] + w, [P, B]))
    return cands


def _splits_rows(c, x_index: int) -> bool:
    """Whether candidate ``c`` splits rows (a dim other than the classes, 1) of ``x`` and of the target
    after it: such candidates hold with the rows blocked alike too (sequence-split logits reshaped
    to ``[tokens, classes]``)."""
    x, target = c.inputs[x_index], c.inputs[x_index + 1]
    return x.is_split and x.dim != 1 and target.is_split


def _row_split_candidates(x, target, weight=None, reduction=MEAN, ignore_index=-100):
    return [c for c in _nll_forward_candidates(x, target, weight, reduction, ignore_index) if _splits_rows(c, 0)]


def _row_split_backward(grad_output, x, target, weight=None, reduction=MEAN, ignore_index=-100, total_weight=None):
    return [c for c in _nll_backward_candidates(grad_output, x, target, weight, reduction, ignore_index, total_weight)
            if _splits_rows(c, 1)]


def _cut(piece: torch.Tensor, piece_box, want_box, dims) -> torch.Tensor:
    """``piece`` (lying at ``piece_box``) narrowed along each of ``dims`` to ``want_box``'s range;
    ``dims`` pairs a dim of ``piece`` with the index of its range in ``want_box``."""
    for d, wd in dims:
        start, length = want_box[wd]
        offset = start - piece_box[d][0]
        if offset != 0 or length != piece.shape[d]:
            piece = piece.narrow(d, offset, length)
    return piece


def _local_targets(target, ignore_index, c0, m):
    """Targets of the classes ``[c0, c0 + m)`` shifted by ``-c0``; every other one ignored."""
    mine = (target >= c0) & (target < c0 + m) & (target != ignore_index)
    return torch.where(mine, target - c0, torch.full_like(target, _LOCAL_IGNORE))


def _total_weight(target, weight, ignore_index, dtype) -> torch.Tensor:
    """The sum of ``weight[t]`` (1 without a weight) over the targets not ignored."""
    kept = target != ignore_index
    if weight is None:
        return kept.sum().to(dtype)
    picked = weight[torch.where(kept, target, torch.zeros_like(target))]
    return torch.where(kept, picked, torch.zeros_like(picked)).sum().to(dtype)


def _class_slice(x_layout, rank):
    """(c0, m): the classes of ``rank``'s piece of ``x``, or None when it holds all of them."""
    if len(x_layout.shape) < 2:
        return None
    c0, m = x_layout.cells(rank)[0][0][1]      # the same classes in every box of a blocked or head-tail row split
    return None if (c0, m) == (0, x_layout.shape[1]) else (c0, m)


def _nll_forward_kernel(func, args, kwargs, ins, outs, calls):
    x_layout, t_layout = ins[0], ins[1]
    w_layout = ins[2] if len(ins) > 2 else None
    split = any(v.is_split for v in x_layout.nd_sbp)
    row_axes = [a for a, v in enumerate(t_layout.nd_sbp) if v.is_split]
    results, totals = {}, {}
    for r, (a, kw) in calls.items():
        n = bind(func, a, kw)
        x, target, weight = n["self"], n["target"], n["weight"]
        reduction, ignore_index = n["reduction"], n["ignore_index"]
        if x.dim() < 2:
            results[r] = func(*a, **kw)
            continue
        aligned = tuple(target.shape) == tuple(n for d, n in enumerate(x.shape) if d != 1)
        rows = target if aligned else _cut(target, t_layout.box(r), x_layout.box(r),
                                           [(td, d) for d, td in _row_dims(x)])
        if weight is not None:
            weight = _cut(weight, w_layout.box(r), x_layout.cells(r)[0][0], [(0, 1)])
        classes = _class_slice(x_layout, r)
        local_t, local_ignore = rows, ignore_index
        if classes is not None:
            local_t, local_ignore = _local_targets(rows, ignore_index, *classes), _LOCAL_IGNORE
        if reduction == MEAN and split:
            # the rank's rows over the total weight of every row: counted from its target piece, and
            # where the target is split, summed over the axes that split it (one scalar all-reduced)
            results[r], _ = func(x, local_t, weight, SUM, local_ignore)
            totals[r] = _total_weight(target, n["weight"], ignore_index, x.dtype)
        else:
            results[r] = func(x, local_t, weight, reduction, local_ignore)
    if totals:
        if row_axes:
            totals = _summed_over(t_layout, row_axes, x_layout.dtype, totals)
        results = {r: (out / totals[r], totals[r]) for r, out in results.items()}
    return results


def _summed_over(t_layout, axes, dtype, pieces: dict) -> dict:
    """Scalars (one per held rank) summed over the placement ``axes``: a partial sum all-reduced."""
    nd = tuple(P if a in axes else B for a in range(len(t_layout.nd_sbp)))
    partial = GlobalTensor(Layout((), dtype, t_layout.placement, nd), pieces)
    return box(partial, Layout((), dtype, t_layout.placement, (B,) * len(nd)))._pieces


def _nll_backward_candidates(grad_output, x, target, weight=None, reduction=MEAN, ignore_index=-100,
                             total_weight=None):
    if x.dim() < 2:
        return []
    w = [] if weight is None else [B]
    tw = B if reduction == MEAN else P   # unread but for "mean"; any layout boxes to P for free
    cands = [sig([S(td) if reduction == NONE else B, S(d), S(td)] + w + [tw], [S(d)]) for d, td in _row_dims(x)]
    cands.append(sig([B, S(1), B] + w + [tw], [S(1)]))
    cands.append(sig([P, B, B] + w + [tw], [P]))
    return cands


def _nll_backward_local(rank, ins, outs, *args, **kwargs):
    """Under the class split: the rank's own targets, shifted, and the weight of its classes."""
    x_layout = ins[1]
    classes = _class_slice(x_layout, rank)
    if classes is None:
        return args, kwargs
    func = aten.nll_loss_backward.default   # nll_loss2d_backward has the same arguments
    n = bind(func, args, kwargs)
    n["target"] = _local_targets(n["target"], n["ignore_index"], *classes)
    n["ignore_index"] = _LOCAL_IGNORE
    if n["weight"] is not None:
        n["weight"] = _cut(n["weight"], ins[3].box(rank), x_layout.cells(rank)[0][0], [(0, 1)])
    return call_args(func, n)


def _blocked_rows_aligned(sources, targets) -> bool:
    """Where ``x``'s rows are blocked (sequence-split logits reshaped to ``[tokens, classes]``), the
    kernel takes the target as it lies, piece for piece: its rows must be split as ``x``'s are (a
    blocked piece is no box to cut a broadcast target's rows by)."""
    x, target = targets[0], targets[1]
    if not (x.blocked or x.head_tail):
        return True
    rows = tuple(Split(0 if v.dim == 0 else v.dim - 1, v.blocks, v.order) if v.is_split and v.dim != 1 else B
                 for v in x.nd_sbp)
    return target.nd_sbp == rows


register_rule([aten.nll_loss_forward.default, aten.nll_loss2d_forward.default], _nll_forward_candidates,
              kernel=_nll_forward_kernel, any_order=_row_split_candidates, admit=_blocked_rows_aligned)
register_rule([aten.nll_loss_backward.default, aten.nll_loss2d_backward.default], _nll_backward_candidates,
              local=_nll_backward_local, any_order=_row_split_backward)
