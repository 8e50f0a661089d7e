"""Indexing: advanced indexing (``x[idx]``, ``x[:, idx]``), index_select, gather, scatter,
index_put / index_add / index_copy / index_fill / index_reduce.

A split of a dim that is *not* indexed survives: each rank indexes its own piece with the
whole (broadcast) index. A split of the index itself splits the result along the dims the
index gives it, the indexed tensor broadcast. Gathers are data movement, so they are linear:
``P -> P`` with the index broadcast. Scatters that *add* (scatter_add, index_add,
``index_put(accumulate=True)``, scatter_reduce "sum") are linear in the tensor and the source
together (``P, P -> P``), and also take a split index with its split source into a partial
result: each rank adds its part of the source into its own partial piece (zeros where it
holds none), and the parts sum to the whole -- the pattern of an embedding's backward.
Scatters that overwrite keep only the splits of dims they do not index.

``gather`` / ``scatter`` off their ``dim`` pair row i of the index with row i of the tensor,
so there the index splits only together with the tensor (and only where their sizes agree);
along ``dim`` the index carries global positions, so it may split alone.

A split of an indexed dim would need each rank's index moved into its piece's coordinates
and the rows it does not hold masked out; with no candidate for it, such an input is
gathered first. ``x[mask] = v`` with one value is a masked fill: the mask splits along with
``x``. Reading through a boolean mask (``x[x > 0]``, ``masked_select``, ``nonzero``) gives a
data-dependent shape: it runs through the fallback.
"""
from __future__ import annotations

import torch

from ..registry import aten, register_rule
from .common import B, P, S, bind, norm_dim, sig


class _Advanced:
    """Where the dims of ``x`` go in ``x[indices]`` (PyTorch's advanced-indexing rules).

    ``kept``: non-indexed dim of ``x`` -> its dim in the result; ``r_start``: the result dim of
    the first of the ``n_r`` dims the broadcast index tensors give; ``r_shape``: their shape,
    None where a boolean mask makes it data-dependent."""

    def __init__(self, x, indices):
        self.tensors = [t for t in indices if t is not None]
        self.has_bool = any(t.dtype in (torch.bool, torch.uint8) for t in self.tensors)
        covered, entries, d = set(), [], 0
        for t in indices:
            width = t.dim() if t is not None and t.dtype in (torch.bool, torch.uint8) else 1
            if t is not None:
                covered.update(range(d, d + width))
                entries.append(d)
            d += width
        rest = [k for k in range(x.dim()) if k not in covered]
        if self.has_bool:
            self.r_shape, self.n_r = None, 1 if self.tensors else 0
            longs = [t for t in self.tensors if t.dtype not in (torch.bool, torch.uint8)]
            if longs:
                self.n_r = max(1, max(t.dim() for t in longs))
        else:
            self.r_shape = tuple(torch.broadcast_shapes(*[t.shape for t in self.tensors])) if self.tensors else ()
            self.n_r = len(self.r_shape)
        first = min(covered) if covered else 0
        adjacent = bool(covered) and covered == set(range(first, max(covered) + 1))
        if adjacent and self._entries_adjacent(indices):
            self.r_start = first
            self.kept = {k: (k if k < first else k - len(covered) + self.n_r) for k in rest}
        else:
            self.r_start = 0
            self.kept = {k: self.n_r + i for i, k in enumerate(rest)}
        self.out_ndim = len(rest) + self.n_r

    @staticmethod
    def _entries_adjacent(indices) -> bool:
        """The non-None entries of ``indices`` are consecutive (no None between them)."""
        pos = [i for i, t in enumerate(indices) if t is not None]
        return not pos or pos[-1] - pos[0] + 1 == len(pos)

    def index_sbp(self, q: int) -> list:
        """Each index tensor's SBP when the broadcast index dims are split at ``q``."""
        out = []
        for t in self.tensors:
            k = q - (self.n_r - t.dim())
            out.append(S(k) if k >= 0 and (t.shape[k] != 1 or self.r_shape[q] == 1) else B)
        return out


def _value_sbp(values, out_ndim: int, out_dim: int, out_size: int):
    """The SBP of a tensor broadcast against a result of ``out_ndim`` dims split at ``out_dim``."""
    k = out_dim - (out_ndim - values.dim())
    return S(k) if k >= 0 and (values.shape[k] != 1 or out_size == 1) else B


@register_rule(aten.index.Tensor)
def _index(x, indices):
    adv = _Advanced(x, indices)
    n = len(adv.tensors)
    cands = [sig([S(d)] + [B] * n, [S(o)]) for d, o in adv.kept.items()]
    if not adv.has_bool:
        cands += [sig([B] + adv.index_sbp(q), [S(adv.r_start + q)]) for q in range(adv.n_r)
                  if adv.r_shape[q] > 0]
    return cands + [sig([P] + [B] * n, [P])]


def _index_put(*args, **kwargs):
    a = bind(aten.index_put.default, args, kwargs)
    x, indices, values, accumulate = a["self"], a["indices"], a["values"], a["accumulate"]
    adv = _Advanced(x, indices)
    n = len(adv.tensors)
    cands = [sig([S(d)] + [B] * n + [_value_sbp(values, adv.out_ndim, o, x.shape[d])], [S(d)])
             for d, o in adv.kept.items()]
    if adv.has_bool and n == 1 and indices[0] is not None and values.numel() == 1:
        # x[mask] = v with a mask over x's leading dims and one value: a masked fill, so the mask
        # splits along with x (each rank fills its own elements)
        mask = indices[0]
        cands += [sig([S(d), S(d), B], [S(d)]) for d in range(mask.dim()) if mask.shape[d] == x.shape[d]]
    if accumulate:
        cands.append(sig([P] + [B] * n + [P], [P]))
        if not adv.has_bool:
            for q in range(adv.n_r):
                o = adv.r_start + q
                cands.append(sig([P] + adv.index_sbp(q) + [_value_sbp(values, adv.out_ndim, o, adv.r_shape[q])],
                                 [P]))
    return cands


register_rule([aten.index_put, aten.index_put_, aten._index_put_impl_], _index_put)


@register_rule(aten.index_select)
def _index_select(x, dim, index, **kwargs):
    dim = norm_dim(dim, x.dim())
    cands = [sig([S(d), B], [S(d)]) for d in range(x.dim()) if d != dim]
    if index.dim() == 1 and x.dim() > 0:   # a 0-dim input takes exactly one index: no piece may be empty
        cands.append(sig([B, S(0)], [S(dim)]))
    return cands + [sig([P, B], [P])]


@register_rule(aten.gather)
def _gather(x, dim, index, **kwargs):
    if x.dim() == 0 or index.dim() == 0:
        return [sig([P, B], [P])]
    dim = norm_dim(dim, x.dim())
    # off ``dim`` the index's row i reads x's row i: both split alike (same size), or neither
    cands = [sig([S(d), S(d)], [S(d)]) for d in range(x.dim()) if d != dim and x.shape[d] == index.shape[d]]
    if index.shape[dim] > 0:
        cands.append(sig([B, S(dim)], [S(dim)]))
    return cands + [sig([P, B], [P])]


def _scatter(op, adds: bool):
    """scatter-like ``op(self, dim, index, [src | value])``: the result has ``self``'s shape."""
    def rule(*args, **kwargs):
        a = bind(op, args, kwargs)
        x, index = a["self"], a["index"]
        src = a.get("src", a.get("source"))
        src = src if isinstance(src, torch.Tensor) else None
        extra = [B] if isinstance(a.get("value"), torch.Tensor) else []
        if x.dim() == 0 or index.dim() == 0:
            return [sig([P, B] + ([P] if src is not None else []) + extra, [P])] if adds else []
        dim = norm_dim(a["dim"], x.dim())
        cands = []
        for d in range(x.dim()):
            if d != dim and x.shape[d] == index.shape[d] and (src is None or src.shape[d] == x.shape[d]):
                cands.append(sig([S(d), S(d)] + ([S(d)] if src is not None else []) + extra, [S(d)]))
        if adds and src is not None:
            cands.append(sig([P, B, P], [P]))
            # a split along ``dim`` only: off it, index row i writes self's row i, which a
            # rank's piece of the index would read as its local row
            if a.get("include_self", True) and index.shape[dim] == src.shape[dim] and index.shape[dim] > 0:
                cands.append(sig([P, S(dim), S(dim)], [P]))
        return cands
    return rule


def _register_scatter(ops, adds: bool) -> None:
    for op in ops:
        register_rule(op, _scatter(op, adds))


_register_scatter([aten.scatter.src, aten.scatter.value, aten.scatter.reduce, aten.scatter.value_reduce,
                   aten.scatter_.src, aten.scatter_.value, aten.scatter_.reduce, aten.scatter_.value_reduce],
                  adds=False)
_register_scatter([aten.scatter_add.default, aten.scatter_add_.default], adds=True)


def _scatter_reduce(op):
    def rule(*args, **kwargs):
        a = bind(op, args, kwargs)
        return _scatter(op, adds=a["reduce"] == "sum")(*args, **kwargs)
    return rule


for _op in (aten.scatter_reduce.two, aten.scatter_reduce_.two):
    register_rule(_op, _scatter_reduce(_op))


def _index_into(op, adds: bool):
    """index_add / index_copy / index_fill ``op(self, dim, index, source | value)``."""
    def rule(*args, **kwargs):
        a = bind(op, args, kwargs)
        x, index = a["self"], a["index"]
        source = a.get("source")
        tail = [None] if isinstance(source, torch.Tensor) or isinstance(a.get("value"), torch.Tensor) else []
        dim = norm_dim(a["dim"], x.dim())
        cands = [sig([S(d), B] + [S(d) if isinstance(source, torch.Tensor) else B for _ in tail], [S(d)])
                 for d in range(x.dim()) if d != dim]
        if adds:
            cands.append(sig([P, B, P], [P]))
            if index.dim() == 1 and source.dim() > 0:
                cands.append(sig([P, S(0), S(dim)], [P]))
        return cands
    return rule


for _op in (aten.index_add.default, aten.index_add_.default):
    register_rule(_op, _index_into(_op, adds=True))
for _packet in (aten.index_copy, aten.index_copy_, aten.index_fill, aten.index_fill_, aten.index_reduce,
                aten.index_reduce_):
    for _name in _packet.overloads():
        if not _name.endswith("out") and "imname" not in _name:
            register_rule(getattr(_packet, _name), _index_into(getattr(_packet, _name), adds=False))
