"""Views and shape ops: a split survives where the dim it splits survives.

view / _unsafe_view keep ``S(d)`` when ``d`` leads its group of merged or split dims (a
group is a run of input dims whose product equals a run of output dims), and when every
rank's piece still has the balanced shape -- checked per rank, since ``[b, t] -> [b*t]``
over k ranks lines up only when the pieces of ``b`` do. The local op gets the rank's own
target shape.
"""
from __future__ import annotations

from ..registry import aten, register_rule
from .common import B, P, S, each_dim_kept, norm_dim, sig


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
    out_shape = tuple(x.view(size).shape) if not rest else tuple(x.shape)
    cands = [sig([P], [P])]
    for gi, gj in _dim_groups(tuple(x.shape), out_shape):
        lead_in = next((d for d in gi if x.shape[d] != 1), None)
        lead_out = next((d for d in gj if out_shape[d] != 1), None)
        if lead_in is not None and lead_out is not None:
            cands.append(sig([S(lead_in)], [S(lead_out)]))
    return cands


def _local_size(rank, ins, outs, x, size, *rest, **kwargs):
    return (x, list(outs[0].piece_shape(rank))) + rest, kwargs


register_rule([aten.view.default, aten._unsafe_view.default, aten.reshape.default], _view_candidates,
              local=_local_size, check_shapes=True)


@register_rule(aten.expand)
def _expand(x, size, *rest, **kwargs):
    off = len(size) - x.dim()
    return [sig([S(d)], [S(d + off)]) for d in range(x.dim()) if x.shape[d] != 1] + [sig([P], [P])]


register_rule(aten.expand, _expand, local=_local_size)


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


@register_rule([aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims])
def _squeeze(x, dims=None):
    if dims is None:
        dims = [d for d in range(x.dim()) if x.shape[d] == 1]
    elif isinstance(dims, int):
        dims = [dims]
    gone = {norm_dim(d, x.dim()) for d in dims if x.shape[norm_dim(d, x.dim())] == 1}
    return [sig([S(d)], [S(d - sum(g < d for g in gone))]) for d in range(x.dim()) if d not in gone] + [
        sig([P], [P])]


@register_rule(aten.slice.Tensor)
def _slice(x, dim=0, *rest, **kwargs):
    return each_dim_kept(x, linear=True, skip={norm_dim(dim, x.dim())})


@register_rule(aten.select.int)
def _select(x, dim, index):
    dim = norm_dim(dim, x.dim())
    return [sig([S(d)], [S(d - (d > dim))]) for d in range(x.dim()) if d != dim] + [sig([P], [P])]


@register_rule([aten.split.Tensor, aten.split_with_sizes.default])
def _split(x, sizes, dim=0):
    dim = norm_dim(dim, x.dim())
    n = len(x.split(sizes, dim))
    return each_dim_kept(x, n_out=n, linear=True, skip={dim})


@register_rule(aten.cat.default)
def _cat(tensors, dim=0):
    ts = [t for t in tensors if not (t.dim() == 1 and t.shape[0] == 0)]
    nd = ts[0].dim() if ts else 1
    dim = norm_dim(dim, nd)
    keep = [sig([S(d) if t.dim() == nd else B for t in tensors], [S(d)]) for d in range(nd) if d != dim]
    return keep + [sig([P] * len(tensors), [P])]


@register_rule(aten.stack.default)
def _stack(tensors, dim=0):
    nd = tensors[0].dim()
    dim = norm_dim(dim, nd + 1)
    return [sig([S(d)] * len(tensors), [S(d if d < dim else d + 1)]) for d in range(nd)] + [
        sig([P] * len(tensors), [P])]
