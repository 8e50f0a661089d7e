"""Losses: ``nll_loss`` / ``nll_loss2d`` (what ``F.cross_entropy`` and ``F.nll_loss`` reach after
``_log_softmax``), and softmax over a split dim for *loss parallelism*.

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
``_log_softmax`` over the split dim, then ``nll_loss_forward`` as above. A softmax over a split
dim is not one local op: the row maximum and the row sum of exponentials span the ranks. This
module gives its exact form, :func:`split_softmax_kernel` (and the backward,
:func:`split_softmax_backward_kernel`): each rank's own row maxima are gathered (``[N, k]``
numbers for ``k`` ranks along the split), the exponentials are summed locally and all-reduced
(``N`` numbers), and each rank finishes its own piece -- the ``[N, C]`` logits never move. The
backward all-reduces one row sum the same way. Unlike a plain kernel these two communicate
(through ``box``, so the bytes are counted and every process issues the same collectives in
the same order; a process holding no rank of the placement skips them). The softmax ops'
rule lives in ``nn_activation.py``; it takes this form by adding
:func:`split_softmax_candidates` / :func:`split_softmax_backward_candidates` to its candidates
and the kernels as its ``kernel`` (they run the plain op on each rank wherever the softmax
dim is not split).
"""
from __future__ import annotations

import math

import torch

from ...boxing import Layout
from ...tensor import GlobalTensor, box
from ..registry import aten, register_rule
from .common import B, P, S, norm_dim, sig

NONE, MEAN, SUM = 0, 1, 2
_LOCAL_IGNORE = -100   # the ignore_index of a rank's own call: never one of its (shifted) classes


def _bound(func, args, kwargs) -> dict:
    """The op's arguments by schema name, defaults filled in."""
    out = {}
    for i, a in enumerate(func._schema.arguments):
        if i < len(args) and not a.kwarg_only:
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
        else:
            out[a.name] = None
    return out


def _call_args(func, named: dict) -> tuple:
    """``(args, kwargs)`` for ``func`` from arguments by name (keyword-only ones as keywords)."""
    args, kwargs = [], {}
    for a in func._schema.arguments:
        if a.kwarg_only:
            kwargs[a.name] = named[a.name]
        else:
            args.append(named[a.name])
    return tuple(args), kwargs


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
            cands.append(sig([S(d), B] + w, [P, B]))
    outs = {NONE: [P, B], SUM: [P, P], MEAN: [P, B]}[reduction]
    cands.append(sig([S(1), B] + w, outs))
    cands.append(sig([P, B] + w, [P, B]))
    return cands


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
    c0, m = x_layout.box(rank)[1]
    return None if (c0, m) == (0, x_layout.shape[1]) else (c0, m)


def _nll_forward_kernel(func, args, kwargs, ins, outs, calls):
    x_layout, t_layout = ins[0], ins[1]
    w_layout = ins[2] if len(ins) > 2 else None
    results = {}
    for r, (a, kw) in calls.items():
        n = _bound(func, a, kw)
        x, target, weight = n["self"], n["target"], n["weight"]
        reduction, ignore_index = n["reduction"], n["ignore_index"]
        if x.dim() < 2:
            results[r] = func(*a, **kw)
            continue
        x_box = x_layout.box(r)
        rows = _cut(target, t_layout.box(r), x_box, [(td, d) for d, td in _row_dims(x)])
        if weight is not None:
            weight = _cut(weight, w_layout.box(r), x_box, [(0, 1)])
        classes = _class_slice(x_layout, r)
        local_t, local_ignore = rows, ignore_index
        if classes is not None:
            local_t, local_ignore = _local_targets(rows, ignore_index, *classes), _LOCAL_IGNORE
        whole = tuple(x.shape) == tuple(x_layout.shape)
        if reduction == MEAN and not whole:
            # the rank's rows over the total weight of every row (the target piece is whole here)
            total = _total_weight(target, n["weight"], ignore_index, x.dtype)
            out, _ = func(x, local_t, weight, SUM, local_ignore)
            results[r] = (out / total, total)
        else:
            results[r] = func(x, local_t, weight, reduction, local_ignore)
    return results


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
    n = _bound(func, args, kwargs)
    n["target"] = _local_targets(n["target"], n["ignore_index"], *classes)
    n["ignore_index"] = _LOCAL_IGNORE
    if n["weight"] is not None:
        n["weight"] = _cut(n["weight"], ins[3].box(rank), x_layout.box(rank), [(0, 1)])
    return _call_args(func, n)


register_rule([aten.nll_loss_forward.default, aten.nll_loss2d_forward.default], _nll_forward_candidates,
              kernel=_nll_forward_kernel)
register_rule([aten.nll_loss_backward.default, aten.nll_loss2d_backward.default], _nll_backward_candidates,
              local=_nll_backward_local)


# -- softmax over a split dim (loss parallel) ------------------------------------------------

def split_softmax_candidates(x, dim, half_to_float=False):
    """``_softmax`` / ``_log_softmax`` with the softmax dim itself split: ``S(dim) -> S(dim)``
    (run by :func:`split_softmax_kernel`)."""
    if x.dim() == 0:
        return []
    d = norm_dim(dim, x.dim())
    return [sig([S(d)], [S(d)])]


def split_softmax_backward_candidates(grad_output, output, dim, input_dtype):
    """``_softmax_backward_data`` / ``_log_softmax_backward_data`` with the dim split:
    ``S(dim), S(dim) -> S(dim)`` (run by :func:`split_softmax_backward_kernel`)."""
    if output.dim() == 0:
        return []
    d = norm_dim(dim, output.dim())
    return [sig([S(d), S(d)], [S(d)])]


def _split_axes(layout: Layout, dim: int) -> list:
    return [a for a, v in enumerate(layout.nd_sbp) if v.is_split and v.dim == dim]


def _with_axes(nd_sbp: tuple, axes, value) -> tuple:
    return tuple(value if a in axes else v for a, v in enumerate(nd_sbp))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _row_total(layout: Layout, dim: int, axes, dtype, pieces: dict) -> dict:
    """Each rank's keepdim sums along ``dim`` (``pieces``) added up over the ranks that split
    ``dim``: a partial-sum tensor all-reduced to broadcast on those axes."""
    shape = tuple(1 if d == dim else n for d, n in enumerate(layout.shape))
    partial = GlobalTensor(Layout(shape, dtype, layout.placement, _with_axes(layout.nd_sbp, axes, P)), pieces)
    return box(partial, Layout(shape, dtype, layout.placement, _with_axes(layout.nd_sbp, axes, B)))._pieces


def _row_max(layout: Layout, dim: int, axes, dtype, pieces: dict) -> dict:
    """The maximum along ``dim`` over the whole dim: each rank's own maxima, gathered along the
    axes that split ``dim`` (one number per rank and row), then reduced locally."""
    k = math.prod(layout.placement.hierarchy[a] for a in axes)
    shape = tuple(k if d == dim else n for d, n in enumerate(layout.shape))
    own = {}
    for r, x in pieces.items():
        if x.shape[dim] == 0:
            own[r] = x.new_full(tuple(1 if d == dim else n for d, n in enumerate(x.shape)), -math.inf)
        else:
            own[r] = x.amax(dim, keepdim=True)
    stacked = GlobalTensor(Layout(shape, dtype, layout.placement, layout.nd_sbp), own)
    gathered = box(stacked, Layout(shape, dtype, layout.placement, _with_axes(layout.nd_sbp, axes, B)))
    return {r: g.amax(dim, keepdim=True) for r, g in gathered._pieces.items()}


def split_softmax_kernel(func, args, kwargs, ins, outs, calls):
    """``_softmax`` / ``_log_softmax`` on each held rank; exact when ``dim`` is split."""
    layout = ins[0]
    dim = norm_dim(_bound(func, args, kwargs)["dim"], len(layout.shape))
    axes = _split_axes(layout, dim)
    if not axes or not layout.shape:
        return {r: func(*a, **kw) for r, (a, kw) in calls.items()}
    comp = _compute_dtype(layout.dtype)
    xs = {r: _bound(func, a, kw)["self"].to(comp) for r, (a, kw) in calls.items()}
    top = _row_max(layout, dim, axes, comp, xs)
    shifted = {r: x - top[r] for r, x in xs.items()}
    exps = {r: s.exp() for r, s in shifted.items()}
    total = _row_total(layout, dim, axes, comp, {r: e.sum(dim, keepdim=True) for r, e in exps.items()})
    if func.overloadpacket is aten._log_softmax:
        out = {r: shifted[r] - total[r].log() for r in xs}
    else:
        out = {r: exps[r] / total[r] for r in xs}
    return {r: o.to(outs[0].dtype) for r, o in out.items()}


def split_softmax_backward_kernel(func, args, kwargs, ins, outs, calls):
    """``_softmax_backward_data`` (``y * (g - sum(g * y))``) and ``_log_softmax_backward_data``
    (``g - exp(y) * sum(g)``) on each held rank; the row sums are all-reduced when ``dim`` is split."""
    layout = ins[1]
    dim = norm_dim(_bound(func, args, kwargs)["dim"], len(layout.shape))
    axes = _split_axes(layout, dim)
    if not axes or not layout.shape:
        return {r: func(*a, **kw) for r, (a, kw) in calls.items()}
    comp = _compute_dtype(ins[0].dtype)
    log = func.overloadpacket is aten._log_softmax_backward_data
    gs, ys = {}, {}
    for r, (a, kw) in calls.items():
        n = _bound(func, a, kw)
        gs[r], ys[r] = n["grad_output"].to(comp), n["output"].to(comp)
    sums = {r: (gs[r] if log else gs[r] * ys[r]).sum(dim, keepdim=True) for r in gs}
    total = _row_total(layout, dim, axes, comp, sums)
    if log:
        out = {r: gs[r] - ys[r].exp() * total[r] for r in gs}
    else:
        out = {r: ys[r] * (gs[r] - total[r]) for r in gs}
    return {r: o.to(outs[0].dtype) for r, o in out.items()}
