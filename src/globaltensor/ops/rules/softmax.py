"""Softmax and log_softmax, forward and backward, on any layout -- the softmax dim split too.

Each row is normalised along ``dim`` by itself, so a split of any other dim passes through:
``S(d) -> S(d)``, ``d != dim``. The backward ops are linear in the incoming gradient given the
forward output (``g*y - y*sum(g*y)`` and ``g - exp(y)*sum(g)``), so a partial gradient stays
partial: ``P, B -> P``.

A split of the softmax dim itself (the classes of the logits: *loss parallel*) is exact too,
``S(dim) -> S(dim)``, but it is not one local op: the row maximum and the row sum of
exponentials span the ranks. :func:`split_softmax_kernel` gathers each rank's own row maxima
(``[N, k]`` numbers for ``k`` ranks along the split), sums the exponentials locally and
all-reduces them (``N`` numbers), and each rank finishes its own piece -- the ``[N, C]``
logits never move. The backward all-reduces one row sum the same way. These kernels
communicate through ``box`` on those small tensors, so the bytes are counted and every process
issues the same collectives in the same order; wherever the softmax dim is not split they run
the plain op on each rank.
"""
from __future__ import annotations

import math

import torch

from ...boxing import Layout
from ...tensor import GlobalTensor, box
from ..registry import aten, register_rule
from .common import B, P, S, bind, each_dim_kept, norm_dim, sig


def _softmax(x, dim, half_to_float):
    return each_dim_kept(x, skip={norm_dim(dim, x.dim())}) + (
        [sig([S(norm_dim(dim, x.dim()))], [S(norm_dim(dim, x.dim()))])] if x.dim() else [])


def _softmax_backward(grad_output, output, dim, input_dtype):
    dim = norm_dim(dim, output.dim())
    return [sig([S(d), S(d)], [S(d)]) for d in range(output.dim())] + [sig([P, B], [P])]


def _rows_kept(x, dim, *rest):
    """The candidates splitting a dim other than the softmax dim: each row's classes stay together,
    so a blocked split of those dims (sequence-split logits reshaped to ``[tokens, vocab]``) holds."""
    return each_dim_kept(x, skip={norm_dim(dim, x.dim())})


def _rows_kept_backward(grad_output, output, dim, input_dtype):
    dim = norm_dim(dim, output.dim())
    return [sig([S(d), S(d)], [S(d)]) for d in range(output.dim()) if d != dim]


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


#: the row blocks the exponentials of a split softmax are summed in
EXP_BLOCKS = 8


def _sum_exp(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x.exp().sum(dim, keepdim=True)`` a block of rows at a time, so that the exponentials of
    only one block exist at once -- a loss's logits are the largest tensor of a step. Each row is
    summed whole, as in one call."""
    rows = next((d for d in range(x.dim()) if d != dim and x.shape[d] > 1), None)
    if rows is None:
        return x.exp().sum(dim, keepdim=True)
    block = -(-x.shape[rows] // EXP_BLOCKS)
    return torch.cat([b.exp().sum(dim, keepdim=True) for b in x.split(block, rows)], rows)


def split_softmax_kernel(func, args, kwargs, ins, outs, calls):
    """``_softmax`` / ``_log_softmax`` on each held rank; exact when ``dim`` is split."""
    layout = ins[0]
    dim = norm_dim(bind(func, args, kwargs)["dim"], len(layout.shape))
    axes = _split_axes(layout, dim)
    if not axes or not layout.shape:
        return {r: func(*a, **kw) for r, (a, kw) in calls.items()}
    comp = _compute_dtype(layout.dtype)
    xs = {r: bind(func, a, kw)["self"].to(comp) for r, (a, kw) in calls.items()}
    top = _row_max(layout, dim, axes, comp, xs)
    shifted = {r: x - top[r] for r, x in xs.items()}
    total = _row_total(layout, dim, axes, comp, {r: _sum_exp(s, dim) for r, s in shifted.items()})
    # the output is written over the shifted logits: beside the input, one logits-sized tensor, as
    # torch's own kernel holds (its whole-vocabulary loss peaks at 3 float32 logits, so does this)
    if func.overloadpacket is aten._log_softmax:
        out = {r: shifted[r].sub_(total[r].log()) for r in xs}
    else:
        out = {r: shifted[r].exp_().div_(total[r]) for r in xs}
    return {r: o.to(outs[0].dtype) for r, o in out.items()}


def split_softmax_backward_kernel(func, args, kwargs, ins, outs, calls):
    """``_softmax_backward_data`` (``y * (g - sum(g * y))``) and ``_log_softmax_backward_data``
    (``g - exp(y) * sum(g)``) on each held rank; the row sums are all-reduced when ``dim`` is split."""
    layout = ins[1]
    dim = norm_dim(bind(func, args, kwargs)["dim"], len(layout.shape))
    axes = _split_axes(layout, dim)
    if not axes or not layout.shape:
        return {r: func(*a, **kw) for r, (a, kw) in calls.items()}
    comp = _compute_dtype(ins[0].dtype)
    log = func.overloadpacket is aten._log_softmax_backward_data
    gs, ys = {}, {}
    for r, (a, kw) in calls.items():
        n = bind(func, a, kw)
        gs[r], ys[r] = n["grad_output"].to(comp), n["output"].to(comp)
    sums = {r: (gs[r] if log else gs[r] * ys[r]).sum(dim, keepdim=True) for r in gs}
    total = _row_total(layout, dim, axes, comp, sums)
    if log:      # g - exp(y) * sum(g), in the one new tensor exp(y)
        out = {r: ys[r].exp().mul_(total[r]).neg_().add_(gs[r]) for r in gs}
    else:
        out = {r: (gs[r] - total[r]).mul_(ys[r]) for r in gs}
    return {r: o.to(outs[0].dtype) for r, o in out.items()}


register_rule([aten._softmax.default, aten._log_softmax.default], _softmax, kernel=split_softmax_kernel,
              any_order=_rows_kept)
register_rule([aten._softmax_backward_data.default, aten._log_softmax_backward_data.default], _softmax_backward,
              kernel=split_softmax_backward_kernel, any_order=_rows_kept_backward)
