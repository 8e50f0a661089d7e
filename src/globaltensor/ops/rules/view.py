"""Views and shape ops: a split survives where the dim it splits survives.

view / _unsafe_view / reshape keep ``S(d)`` when ``d`` leads its group of merged or split dims
(a group is a run of input dims whose product equals a run of output dims), and when every
rank's piece still has the balanced shape -- checked per rank, since ``[b, t] -> [b*t]`` over k
ranks lines up only when the pieces of ``b`` do. The local op gets the rank's own target shape
(and a contiguous copy of a piece that a view cannot reshape, e.g. a transposed one: the
global tensor is always contiguous, its pieces need not be).

``slice`` along a split dim keeps the split where the pieces line up (``x[::2]`` of an even
split, say): each rank slices its own piece with the start and end moved into its
coordinates, and the per-rank check keeps the candidate only where every rank's part is its
balanced piece of the result. ``squeeze`` removes only dims of global size 1 from a piece,
never a split dim whose piece happens to have size 1. ``flip`` (not a view, but a shape op)
keeps the splits of the dims it does not flip, ``constant_pad_nd`` (``F.pad``) those of the
dims it does not pad (``P -> P`` only when padding with 0), ``unfold`` (sliding windows) those
of the dims it does not window; ``diagonal`` keeps the splits of the dims it does not take
the diagonal of. Their backward ops (``unfold_backward``, ``diagonal_backward``) keep the
same splits, with the input's size rewritten to the rank's piece shape.

A split of a merged dim that does not lead its group is kept as a blocked split of the merged
dim (``[b, h] S(1) -> [b*h] S(0, blocks=b)``: torch.matmul's reshape of split attention
heads), and unmerging at the blocks gives the plain split back; a group of one dim keeps its
split's blocks. ``cat`` of equal split tensors along their split dim is a blocked split
(``[q | k | v]``), and ``split`` into the blocks hands each out plainly split.

Every view is linear, so ``P -> P`` everywhere. The in-place forms that change a tensor's
metadata (``transpose_``, ``t_``, ``squeeze_``, ``unsqueeze_``) take their SBP from these
rules (ops/writes/metadata_ops.py).
"""
from __future__ import annotations

import torch

from ...compat.torch_ops import prims
from ..registry import aten, register_rule
from ...sbp.shape import numel
from .common import B, P, S, bind, each_dim_kept, is_zero, norm_dim, sig




# -- view / reshape ---------------------------------------------------------------------------

def _dim_groups(src: tuple, dst: tuple) -> list:
    """Pairs (input dims, output dims) of runs whose sizes multiply to the same number."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi, gj = [i] if i < len(src) else [], [j] if j < len(dst) else []
        pi = src[i] if i < len(src) else 1
        pj = dst[j] if j < len(dst) else 1
        i, j = i + bool(gi), j + bool(gj)
        while pi != pj:
            if pi < pj and i < len(src):
                gi.append(i); pi *= src[i]; i += 1
            elif j < len(dst):
                gj.append(j); pj *= dst[j]; j += 1
            else:
                gi.append(i); pi *= src[i]; i += 1
        groups.append((gi, gj))
    return groups


def _view_candidates(x, size, *rest, **kwargs):
    out_shape = tuple(x.reshape(size).shape)
    cands = [sig([P], [P])]
    if x.numel() == 0:
        return cands
    for gi, gj in _dim_groups(tuple(x.shape), out_shape):
        lead_in = next((d for d in gi if x.shape[d] != 1), gi[0] if gi else None)
        lead_out = next((d for d in gj if out_shape[d] != 1), gj[0] if gj else None)
        if lead_in is not None and lead_out is not None:
            cands.append(sig([S(lead_in)], [S(lead_out)]))
        cands += _blocked_groups(tuple(x.shape), out_shape, gi, gj)
    return cands


def _blocked_groups(shape: tuple, out_shape: tuple, gi: list, gj: list) -> list:
    """A split of a dim that a merge does not lead is a blocked split of the merged dim (its
    blocks: the dims before it), and a blocked split unmerged at its blocks is a plain split
    of the dim after them: ``[b, h] S(1) <-> [b*h] S(0, blocks=b)``."""
    ins = [d for d in gi if shape[d] != 1]
    outs = [d for d in gj if out_shape[d] != 1]
    if len(outs) == 1:
        return [sig([S(i)], [S(outs[0], blocks=numel(shape[d] for d in gi if d < i))]) for i in ins[1:]]
    if len(ins) == 1:
        return [sig([S(ins[0], blocks=numel(out_shape[d] for d in gj if d < j))], [S(j)]) for j in outs[1:]]
    return []


def _view_blocked(x, size, *rest, **kwargs):
    """Where a group is one dim in and one dim out, its split keeps its blocks."""
    out_shape = tuple(x.reshape(size).shape)
    cands = []
    for gi, gj in _dim_groups(tuple(x.shape), out_shape):
        ins = [d for d in gi if x.shape[d] != 1]
        outs = [d for d in gj if out_shape[d] != 1]
        if len(ins) == 1 and len(outs) == 1:
            cands.append(sig([S(ins[0])], [S(outs[0])]))
    return cands


def _local_size(rank, ins, outs, x, size, *rest, **kwargs):
    return (x, list(outs[0].piece_shape(rank))) + rest, kwargs


def _local_view(rank, ins, outs, x, size, *rest, **kwargs):
    shape = list(outs[0].piece_shape(rank))
    if not x.is_contiguous():
        try:
            x.view(shape)
        except RuntimeError:
            x = x.contiguous()      # a view cannot reshape this piece; the global tensor is contiguous
    return (x, shape) + rest, kwargs


register_rule([aten.view.default, aten._unsafe_view.default, aten.reshape.default], _view_candidates,
              local=_local_view, check_shapes=True, any_order=_view_blocked)


def _expand(x, size, *rest, **kwargs):
    off = len(size) - x.dim()
    return [sig([S(d)], [S(d + off)]) for d in range(x.dim()) if x.shape[d] != 1] + [sig([P], [P])]


register_rule(aten.expand.default, _expand, local=_local_size, any_order=True)


# -- dim permutations --------------------------------------------------------------------------

@register_rule(aten.transpose.int)
def _transpose(x, d0, d1):
    d0, d1 = norm_dim(d0, x.dim()), norm_dim(d1, x.dim())
    swap = {d0: d1, d1: d0}
    return [sig([S(d)], [S(swap.get(d, d))]) for d in range(x.dim())] + [sig([P], [P])]


@register_rule(aten.t.default)
def _t(x):
    return _transpose(x, 0, 1) if x.dim() == 2 else [sig([P], [P])] + ([sig([S(0)], [S(0)])] if x.dim() else [])


@register_rule(aten.permute.default)
def _permute(x, dims):
    dims = [norm_dim(d, x.dim()) for d in dims]
    return [sig([S(d)], [S(dims.index(d))]) for d in range(x.dim())] + [sig([P], [P])]


@register_rule(aten.unsqueeze.default)
def _unsqueeze(x, dim):
    dim = norm_dim(dim, x.dim() + 1)
    return [sig([S(d)], [S(d if d < dim else d + 1)]) for d in range(x.dim())] + [sig([P], [P])]


# -- squeeze ------------------------------------------------------------------------------------

def _squeezed(x, args, kwargs) -> set:
    """The dims of ``x`` that squeeze removes: the asked ones of global size 1."""
    dims = args[0] if args else kwargs.get("dim")
    if dims is None:
        dims = range(x.dim())
    elif isinstance(dims, int):
        dims = [dims]
    return {norm_dim(d, x.dim()) for d in dims if x.dim() and x.shape[norm_dim(d, x.dim())] == 1}


def _squeeze(x, *args, **kwargs):
    gone = _squeezed(x, args, kwargs)
    return [sig([S(d)], [S(d - sum(g < d for g in gone))]) for d in range(x.dim()) if d not in gone] + [
        sig([P], [P])]


def _squeeze_local(rank, ins, outs, x, *args, **kwargs):
    """A piece can have size 1 in a split dim of another global size: squeeze only the global 1s.

    ``squeeze.dim(d)`` of a dim that stays gets a piece with a fresh size-1 dim at ``d`` to
    remove, so the result is still a view of the piece with its own shape."""
    layout = ins[0]
    gone = _squeezed(_Shape(layout.shape), args, kwargs)
    if isinstance(args[0] if args else kwargs.get("dim"), int):
        d = norm_dim(args[0] if args else kwargs["dim"], x.dim())
        return ((x if d in gone else x.unsqueeze(d)), d), {}
    return (x, sorted(gone)), {}


class _Shape:
    """Just enough of a tensor (``dim()``, ``shape``) for :func:`_squeezed` on a global shape."""

    def __init__(self, shape):
        self.shape = shape

    def dim(self):
        return len(self.shape)


register_rule([aten.squeeze.dim, aten.squeeze.dims], _squeeze, local=_squeeze_local, any_order=True)
# squeeze() takes no dims to rewrite: the per-rank check drops splits whose pieces have a size-1 dim.
register_rule(aten.squeeze.default, _squeeze, check_shapes=True)


# -- slicing -------------------------------------------------------------------------------------

def _slice_args(args, kwargs):
    a = bind(aten.slice.Tensor, (None,) + tuple(args), kwargs)
    return a["dim"], a["start"], a["end"], a["step"]


@register_rule(aten.slice.Tensor)
def _slice(x, *args, **kwargs):
    dim, start, end, step = _slice_args(args, kwargs)
    dim = norm_dim(dim, x.dim())
    cands = each_dim_kept(x, linear=True, skip={dim})
    if x.shape[dim] > 0:
        cands.append(sig([S(dim)], [S(dim)]))   # along the split dim: kept where the pieces line up
    return cands


def _slice_local(rank, ins, outs, x, *args, **kwargs):
    """Move the slice's start and end into the coordinates of this rank's piece along ``dim``."""
    dim, start, end, step = _slice_args(args, kwargs)
    layout = ins[0]
    dim = norm_dim(dim, len(layout.shape))
    n = layout.shape[dim]
    a, length = layout.box(rank)[dim]
    if (a, length) == (0, n):
        return (x, dim, start, end, step), {}
    s, e, _ = slice(start, end, step).indices(n)
    lo = max(s, a)
    first = lo + (s - lo) % step                 # the first index >= lo that the slice takes
    last = min(e, a + length)
    first = min(first, a + length)
    return (x, dim, first - a, max(last, first) - a, step), {}


register_rule(aten.slice.Tensor, _slice, local=_slice_local, check_shapes=True)


@register_rule(aten.select.int)
def _select(x, dim, index):
    dim = norm_dim(dim, x.dim())
    return [sig([S(d)], [S(d - (d > dim))]) for d in range(x.dim()) if d != dim] + [sig([P], [P])]


def _split(x, sizes, dim=0):
    """Splits of the other dims stay; cutting a dim of ``f`` blocks into its blocks turns
    ``S(dim, blocks=f)`` into ``S(dim)`` on each (a fused ``[q | k | v]`` into q, k and v)."""
    dim = norm_dim(dim, x.dim())
    parts = x.split(sizes, dim)
    cands = each_dim_kept(x, n_out=len(parts), linear=True, skip={dim})
    if len(parts) > 1 and len({p.shape[dim] for p in parts}) == 1 and parts[0].shape[dim]:
        cands.append(sig([S(dim, blocks=len(parts))], [S(dim)] * len(parts)))
    return cands


def _split_local(rank, ins, outs, x, sizes, dim=0):
    """Cutting a blocked dim into its blocks: each rank cuts its piece into its parts of them."""
    dim = norm_dim(dim, len(ins[0].shape))
    if not any(v.is_split and v.dim == dim for v in ins[0].nd_sbp):
        return (x, sizes, dim), {}
    parts = [o.piece_shape(rank)[dim] for o in outs]
    return (x, parts if isinstance(sizes, (list, tuple)) else parts[0], dim), {}


register_rule([aten.split.Tensor, aten.split_with_sizes.default], _split, local=_split_local, any_order=True,
              check_shapes=True)      # a rank whose parts of the blocks are empty cuts no parts


@register_rule(aten.unbind.int)
def _unbind(x, dim=0):
    """One gather of a split ``dim`` for all the outputs, not one per ``select``."""
    dim = norm_dim(dim, x.dim())
    n = x.shape[dim]
    return [sig([S(d)], [S(d - (d > dim))] * n) for d in range(x.dim()) if d != dim] + [sig([P], [P] * n)]


@register_rule([aten.flip.default, prims.rev.default])
def _flip(x, dims):
    """A split of a dim not flipped stays (a flipped split dim would need the pieces exchanged)."""
    flipped = {norm_dim(d, x.dim()) for d in dims}
    return each_dim_kept(x, linear=True, skip=flipped)


def _constant_pad(x, pad, value=0):
    """``pad`` holds (before, after) pairs for the last dims, the last dim first."""
    padded = {x.dim() - 1 - i // 2 for i, n in enumerate(pad) if n != 0}
    return each_dim_kept(x, linear=value == 0, skip=padded)


def _pads_empty_pieces() -> bool:
    """Whether this torch crops and pads a tensor with an empty dim (torch 2.10 and older raise
    "negative output size" for a piece that an uneven split left empty, when another dim is cropped)."""
    try:
        aten.constant_pad_nd.default(torch.empty(2, 3, 0), [0, 0, -1, 2])
    except RuntimeError:
        return False
    return True


def _pad_pieces(func, args, kwargs, ins, outs, calls):
    """Each rank's piece padded; an empty piece's result made directly (its output is empty too)."""
    value = bind(func, args, kwargs)["value"]
    return {r: torch.full(outs[0].piece_shape(r), value, dtype=outs[0].dtype, device=a[0].device)
            if a[0].numel() == 0 else func(*a, **kw) for r, (a, kw) in calls.items()}


register_rule(aten.constant_pad_nd.default, _constant_pad, kernel=None if _pads_empty_pieces() else _pad_pieces,
              any_order=True, keyed={"value": is_zero})     # the kernel reads the pieces' shapes, no position


@register_rule(aten.unfold.default)
def _unfold(x, dimension, size, step):
    return each_dim_kept(x, linear=True, skip={norm_dim(dimension, x.dim())})


def _unfold_backward(grad, input_sizes, dim, size, step):
    dim = norm_dim(dim, len(input_sizes))
    return [sig([S(d)], [S(d)]) for d in range(len(input_sizes)) if d != dim] + [sig([P], [P])]


def _local_input_sizes(rank, ins, outs, grad, input_sizes, *rest, **kwargs):
    return (grad, list(outs[0].piece_shape(rank))) + rest, kwargs


register_rule(aten.unfold_backward.default, _unfold_backward, local=_local_input_sizes)


def _diagonal_kept(ndim: int, dim1: int, dim2: int) -> dict:
    """Dim of the input -> its dim in the diagonal (the two diagonal dims go, one is appended)."""
    pair = {norm_dim(dim1, ndim), norm_dim(dim2, ndim)}
    return {d: d - sum(p < d for p in pair) for d in range(ndim) if d not in pair}


@register_rule(aten.diagonal.default)
def _diagonal(x, offset=0, dim1=0, dim2=1):
    return [sig([S(d)], [S(k)]) for d, k in _diagonal_kept(x.dim(), dim1, dim2).items()] + [sig([P], [P])]


def _diagonal_backward(grad, input_sizes, offset, dim1, dim2):
    return [sig([S(k)], [S(d)]) for d, k in _diagonal_kept(len(input_sizes), dim1, dim2).items()] + [sig([P], [P])]


register_rule(aten.diagonal_backward.default, _diagonal_backward, local=_local_input_sizes)


# -- joining -----------------------------------------------------------------------------------

@register_rule(aten.cat.default)
def _cat(tensors, dim=0):
    ts = [t for t in tensors if not (t.dim() == 1 and t.shape[0] == 0)]
    nd = ts[0].dim() if ts else 1
    dim = norm_dim(dim, nd)
    keep = [sig([S(d) if t.dim() == nd else B for t in tensors], [S(d)]) for d in range(nd) if d != dim]
    if sum(t.numel() > 0 for t in ts) == 1:     # onto empties (a cache's first update): the one tensor as it is
        keep.append(sig([S(dim) if t.dim() == nd else B for t in tensors], [S(dim)]))
    if len(tensors) > 1 and len({tuple(t.shape) for t in tensors}) == 1 and tensors[0].shape[dim]:
        keep.append(sig([S(dim)] * len(tensors), [S(dim, blocks=len(tensors))]))   # the blocks of a fused tensor
    return keep + [sig([P] * len(tensors), [P])]


@register_rule(aten.stack.default)
def _stack(tensors, dim=0):
    nd = tensors[0].dim()
    dim = norm_dim(dim, nd + 1)
    return [sig([S(d)] * len(tensors), [S(d if d < dim else d + 1)]) for d in range(nd)] + [
        sig([P] * len(tensors), [P])]
