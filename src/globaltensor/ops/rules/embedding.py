"""Embedding lookups: ``embedding(weight [V, D], indices [...]) -> [..., D]`` and the weight's gradient.

Forward candidates:

- ``B, S(d) -> S(d)``: indices split along any of their dims, every rank holds the table.
- ``S(1), B -> S(n)``: the embedding dim split (n = indices.dim(), the output's last dim).
- ``S(0), B -> P``: the vocabulary split. Each rank looks up only the ids in its own range
  ``[lo, lo + len)`` of the table (shifted by ``-lo``) and gives zero rows for the others;
  the pieces sum to the lookup in the whole table.
- ``P, B -> P``: a lookup is linear in the table.

The vocabulary split is not the aten op on the pieces (the ids must be shifted and the
foreign ones masked), so the op runs through a ``kernel``; it reads the range from the rank's
box of the weight's layout, which makes it right for every nd-SBP (``(S(0), S(1))`` too), and
runs the plain op where a rank holds the whole vocabulary.

``embedding_dense_backward(grad [..., D], indices, V, padding_idx, scale_grad_by_freq) -> [V, D]``:

- ``S(d), S(d) -> P``: each rank scatters its own rows' gradients into the whole table's;
  not with ``scale_grad_by_freq``, whose counts must be over all the indices.
- ``S(n), B -> S(1)``: the embedding dim split.
- ``B, B -> S(0)``: each rank makes the gradient of its vocabulary range (so a vocab-split
  table gets its gradient as S(0), with no communication), from the ids in its range only --
  the others go to an extra row that is cut off, so ``padding_idx`` and frequency counts stay
  exact and no shape depends on the ids.
- ``P, B -> P``: linear in the gradient.

An id outside ``[0, V)`` raises on one device; under the vocabulary split no rank owns it and
its row is zero instead.

``embedding_renorm_(weight, indices, max_norm, norm_type)`` (``nn.Embedding(max_norm=...)``)
scales, in place, each looked-up row whose norm exceeds ``max_norm``. A row's norm is over the
embedding dim, so only the vocabulary split is exact: ``S(0), B -> S(0)``, each rank renorming
the rows in its range (the ids shifted by ``-lo``, the others sent to a zero row that is never
renormed) -- a kernel, as for the lookup. The weight keeps its layout: one split along the embedding dim is gathered for
the functional ``embedding_renorm`` and the result written back into its pieces.
"""
from __future__ import annotations

import torch

from ..registry import aten, register_rule
from ..schema.op_record import record
from .common import B, P, S, bind, sig


def _local_padding(padding_idx: int, lo: int, n: int) -> int:
    return padding_idx - lo if padding_idx >= 0 and lo <= padding_idx < lo + n else -1


def _embedding_candidates(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return _ids_split(weight, indices) + [sig([S(1), B], [S(indices.dim())]), sig([S(0), B], [P]), sig([P, B], [P])]


def _ids_split(weight, indices, *rest) -> list:
    """Rows looked up where their ids lie: these hold in any order of the ids (head-tail too)."""
    return [sig([B, S(d)], [S(d)]) for d in range(indices.dim())]


def _embedding_kernel(func, args, kwargs, ins, outs, calls):
    vocab = ins[0].shape[0]
    results = {}
    for r, (ra, rkw) in calls.items():
        lo, n = ins[0].box(r)[0]
        if (lo, n) == (0, vocab):
            results[r] = func(*ra, **rkw)
            continue
        a = bind(func, ra, rkw)
        weight, ids = a["weight"], a["indices"]
        inside = (ids >= lo) & (ids < lo + n)
        if n == 0:
            results[r] = weight.new_zeros(tuple(ids.shape) + (weight.shape[1],))
            continue
        local_ids = (ids - lo).masked_fill_(~inside, 0)
        out = func(weight, local_ids, _local_padding(a["padding_idx"], lo, n), a["scale_grad_by_freq"],
                   a["sparse"])
        results[r] = out.masked_fill_(~inside.unsqueeze(-1), 0)
    return results


register_rule(aten.embedding.default, _embedding_candidates, kernel=_embedding_kernel, any_order=_ids_split)


def _dense_backward_candidates(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    local = _rows_scattered(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq)
    return local + [sig([S(indices.dim()), B], [S(1)]), sig([B, B], [S(0)]), sig([P, B], [P])]


def _rows_scattered(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq) -> list:
    """Each rank's rows scattered into a partial gradient: in any order of the ids (head-tail too)."""
    return [] if scale_grad_by_freq else [sig([S(d), S(d)], [P]) for d in range(indices.dim())]


def _dense_backward_kernel(func, args, kwargs, ins, outs, calls):
    """Each rank scatters the rows of the ids in its vocabulary range, shifted by ``-lo``; the other
    ids go to one extra row past the range, cut off after, so the shapes do not depend on the ids
    (a captured graph runs it) and ``padding_idx`` and the frequency counts stay exact."""
    vocab = outs[0].shape[0]
    results = {}
    for r, (ra, rkw) in calls.items():
        lo, n = outs[0].box(r)[0]
        if (lo, n) == (0, vocab):
            results[r] = func(*ra, **rkw)
            continue
        a = bind(func, ra, rkw)
        ids = a["indices"]
        local_ids = (ids - lo).masked_fill_((ids < lo) | (ids >= lo + n), n)
        results[r] = func(a["grad_output"], local_ids, n + 1, _local_padding(a["padding_idx"], lo, n),
                          a["scale_grad_by_freq"])[:n]
    return results


register_rule(aten.embedding_dense_backward.default, _dense_backward_candidates, kernel=_dense_backward_kernel,
              any_order=_rows_scattered)


def _renorm_kernel(func, args, kwargs, ins, outs, calls):
    """Each rank renorms the rows of its vocabulary range: the ids inside it, shifted by ``-lo``. The
    other ids go to a zero row appended to a copy of the piece (a zero row is never renormed), so
    the shapes do not depend on the ids; the piece then takes the copy's rows."""
    vocab = ins[0].shape[0]
    results = {}
    for r, (ra, rkw) in calls.items():
        a = bind(func, ra, rkw)
        lo, n = ins[0].box(r)[0]
        weight, ids = a["self"], a["indices"]
        if (lo, n) == (0, vocab):
            results[r] = func(weight, ids, a["max_norm"], a["norm_type"])
            continue
        local_ids = (ids - lo).masked_fill_((ids < lo) | (ids >= lo + n), n)
        padded = torch.cat([weight, weight.new_zeros((1,) + tuple(weight.shape[1:]))])
        renormed = func(padded, local_ids, a["max_norm"], a["norm_type"])[:n]
        results[r] = weight.copy_(renormed) if record(func).in_place else renormed
    return results


register_rule([aten.embedding_renorm_.default, aten.embedding_renorm.default], [sig([S(0), B], [S(0)])],
              kernel=_renorm_kernel)
