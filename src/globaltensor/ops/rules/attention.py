"""Scaled dot-product attention: what ``F.scaled_dot_product_attention`` reaches on CPU.

``_scaled_dot_product_flash_attention_for_cpu(q [B, H, L, E], k [B, Hk, S, E], v [B, Hk, S, Ev],
dropout_p, is_causal, *, attn_mask?, scale?) -> (out [B, H, L, Ev], logsumexp [B, H, L])`` and its
backward ``(grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, *, attn_mask?, scale?) ->
(grad_q, grad_k, grad_v)``. (With ``dropout_p > 0`` sdpa takes the math path instead: bmm and
softmax, which have rules of their own.) A boolean mask reaches the op already turned into an
additive float mask; it broadcasts against ``[B, H, L, S]``.

Every (batch, head) pair attends by itself, and every query row by itself given all of k and v:

- batch split: ``S(0)`` on q, k, v (the mask ``S`` on its batch dim, or ``B`` where it has
  none) -> ``S(0), S(0)``; backward all ``S(0)``.
- head split: ``S(1)`` on q, k, v -> ``S(1), S(1)``; backward all ``S(1)``. Under grouped-query
  attention (``enable_gqa=True``: ``H = G * Hk``, query head ``h`` reads kv head ``h // G``) only
  where each rank's query heads are its kv heads' groups (``admit``: attention_cost.py
  ``heads_line_up``), as when the ranks divide Hk.
- GQA with the kv heads whole: q ``S(1)``, k and v ``B`` -> ``S(1), S(1)`` (fewer kv heads than
  ranks: each rank takes the kv heads its query heads read -- ``local`` -- as Megatron repeats them
  over the ranks); backward -> ``S(1), P, P`` (each rank adds its query heads' share to the kv
  heads they read, zero elsewhere).
- query split: q ``S(2)``, k and v ``B`` (the mask ``S`` on its query dim) -> ``S(2), S(2)``;
  backward: grad_out, q, out, logsumexp ``S(2)``, k, v ``B`` -> ``S(2), P, P`` (each rank's rows
  add their part to the k and v gradients). ``is_causal`` means query ``i`` sees keys ``<= i``
  (top-left aligned); a rank holding rows ``[r0, r0 + n)`` gets that as an explicit additive
  mask of its rows (``local``), since its own ``is_causal`` would start at row 0.
- sequence split (ring attention, ring_attention.py): q, k, v ``S(2)`` (the mask ``S`` on its query
  dim) -> ``S(2), S(2)``; backward all ``S(2)``. Its kernel passes key/value blocks between ranks.
- backward with a partial ``grad_out`` (the rest ``B``): the gradients are linear in it ->
  ``P, P, P``.

A rank whose pieces have no heads or no query rows does not call the op -- the CPU kernel dies
with SIGFPE on such shapes -- and makes its (empty, or for grad_k / grad_v zero) pieces itself.
"""
from __future__ import annotations

import math

import torch

from ..registry import aten, register_rule
from .common import B, P, S, bind, call_args, sig
from .attention_cost import DROPOUT, admit_attention, attention_kernel_bytes, kv_heads_read
from .ring_attention import ring_backward, ring_forward, seq_axes

_FWD = aten._scaled_dot_product_flash_attention_for_cpu.default
_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _mask(mask, d) -> list:
    """The mask's SBP when dim ``d`` of ``[B, H, L, S]`` is split (none without a mask)."""
    if mask is None:
        return []
    k = d - (4 - mask.dim())
    return [S(k) if k >= 0 and mask.shape[k] != 1 else B]


def _shapes_ok(q, k, v) -> bool:
    return q.dim() == 4 and k.dim() == 4 and v.dim() == 4


def _forward_candidates(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    if dropout_p != 0 or not _shapes_ok(query, key, value):
        return []
    cands = [sig([S(0)] * 3 + _mask(attn_mask, 0), [S(0), S(0)]),
             sig([S(1)] * 3 + _mask(attn_mask, 1), [S(1), S(1)])]
    if query.shape[1] != key.shape[1]:
        cands.append(sig([S(1), B, B] + _mask(attn_mask, 1), [S(1), S(1)]))
    cands.append(sig([S(2)] * 3 + _mask(attn_mask, 2), [S(2), S(2)]))               # ring attention
    if not (is_causal and attn_mask is not None):
        cands.append(sig([S(2), B, B] + _mask(attn_mask, 2), [S(2), S(2)]))
    return cands


def _sequence_forward(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """The forward's candidates that read only the sequence's positions (their ranges), so hold in
    head-tail order too: ring attention, and the query split."""
    return [c for c in _forward_candidates(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
            if c.inputs[0] == S(2)]


def _sequence_backward(grad_out, query, key, value, out, logsumexp, dropout_p=0.0, is_causal=False, *,
                       attn_mask=None, scale=None):
    """The backward's, as :func:`_sequence_forward`."""
    return [c for c in _backward_candidates(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal,
                                            attn_mask=attn_mask, scale=scale) if c.inputs[1] == S(2)]


def _backward_candidates(grad_out, query, key, value, out, logsumexp, dropout_p=0.0, is_causal=False, *,
                         attn_mask=None, scale=None):
    if dropout_p != 0 or not _shapes_ok(query, key, value):
        return []
    cands = [sig([S(0)] * 6 + _mask(attn_mask, 0), [S(0)] * 3), sig([S(1)] * 6 + _mask(attn_mask, 1), [S(1)] * 3)]
    if query.shape[1] != key.shape[1]:
        cands.append(sig([S(1), S(1), B, B, S(1), S(1)] + _mask(attn_mask, 1), [S(1), P, P]))
    cands.append(sig([S(2)] * 6 + _mask(attn_mask, 2), [S(2)] * 3))                   # ring attention
    if not (is_causal and attn_mask is not None):
        cands.append(sig([S(2), S(2), B, B, S(2), S(2)] + _mask(attn_mask, 2), [S(2), P, P]))
    cands.append(sig([P] + [B] * 5 + ([B] if attn_mask is not None else []), [P, P, P]))
    return cands


def _causal_rows(query_layout, rank, query, key):
    """``is_causal`` for the rank's query rows (their ranges of the sequence: one, or two under a
    head-tail split) as an additive mask, or None when the rank holds every row."""
    ranges = query_layout.segments(rank, 2)
    if len(ranges) == 1 and ranges[0][2] == query_layout.shape[2]:
        return None
    rows = torch.cat([torch.arange(r0, r0 + n, device=query.device) for r0, _, n in ranges] or
                     [torch.zeros(0, dtype=torch.long, device=query.device)]).unsqueeze(1)
    cols = torch.arange(key.shape[2], device=query.device).unsqueeze(0)
    zero = torch.zeros((), dtype=query.dtype, device=query.device)
    return torch.where(cols <= rows, zero, torch.full((), -math.inf, dtype=query.dtype, device=query.device))


def _local(func, q_index):
    """Per rank: the kv heads its query heads read (GQA with the kv heads whole), and ``is_causal``
    as a mask of its query rows (a query split)."""
    def local(rank, ins, outs, *args, **kwargs):
        n = bind(func, args, kwargs)
        read = kv_heads_read(ins[q_index], ins[q_index + 1], rank)
        mask = None
        if n["is_causal"] and not seq_axes(ins[q_index + 1]):     # ring attention masks its blocks itself
            mask = _causal_rows(ins[q_index], rank, n["query"], n["key"])
        if read is None and mask is None:
            return args, kwargs
        if read is not None:
            n["key"], n["value"] = (_heads(t, read) for t in (n["key"], n["value"]))
        if mask is not None:
            n["is_causal"], n["attn_mask"] = False, mask
        return call_args(func, n)
    return local


def _heads(t, read: list):
    """The kv heads ``read`` lists, one per query head: a narrowing where they are a run of whole
    groups or one kv head (the kernel's own GQA then pairs them), else a copy with one kv head per
    query head."""
    first, last = read[0], read[-1]
    if first == last:
        return t.narrow(1, first, 1)
    heads = len(read)
    runs = last - first + 1
    if heads % runs == 0 and read == [first + i // (heads // runs) for i in range(heads)]:
        return t.narrow(1, first, runs)
    return t.index_select(1, torch.tensor(read, device=t.device))


def _kv_grad_whole(grad, read: list, kv_heads: int):
    """A rank's gradient of the kv heads it read (as :func:`_heads` took them) as its share of all
    ``kv_heads``: added at the heads read, zero elsewhere (a partial sum over the ranks)."""
    whole = grad.new_zeros(grad.shape[0], kv_heads, *grad.shape[2:])
    first, last = read[0], read[-1]
    if grad.shape[1] == len(read):
        return whole.index_add_(1, torch.tensor(read, device=grad.device), grad)
    whole.narrow(1, first, last - first + 1).copy_(grad)
    return whole


def _forward_kernel(func, args, kwargs, ins, outs, calls):
    if seq_axes(ins[1]):
        return _ring_forward(func, ins, outs, calls)
    results = {}
    for r, (a, kw) in calls.items():
        q = bind(func, a, kw)["query"]
        if q.shape[1] == 0 or q.shape[2] == 0 or q.shape[0] == 0:
            results[r] = tuple(torch.empty(o.piece_shape(r), dtype=o.dtype, device=q.device) for o in outs)
        else:
            results[r] = func(*a, **kw)
    return results


def _backward_kernel(func, args, kwargs, ins, outs, calls):
    if seq_axes(ins[2]):
        return _ring_backward(func, ins, calls)
    results = {}
    for r, (a, kw) in calls.items():
        q = bind(func, a, kw)["query"]
        read = kv_heads_read(ins[1], ins[2], r)
        if q.shape[0] == 0 or q.shape[1] == 0 or q.shape[2] == 0:
            # no rows here: grad_q is empty, grad_k / grad_v (whole or empty pieces) are zero
            results[r] = (q.new_empty(q.shape), *(torch.zeros(o.piece_shape(r), dtype=o.dtype, device=q.device)
                                                  for o in outs[1:]))
        elif read is not None:
            grad_q, grad_k, grad_v = func(*a, **kw)
            kv_heads = ins[2].shape[1]
            results[r] = (grad_q, _kv_grad_whole(grad_k, read, kv_heads), _kv_grad_whole(grad_v, read, kv_heads))
        else:
            results[r] = func(*a, **kw)
    return results


def _ring_forward(func, ins, outs, calls):
    """Ring attention (ring_attention.py) with the CPU op as the block kernel. The log-sum-exp stays
    as merged, in the query's dtype (float32 for lower precisions): the kernel's own, which its
    backward reads -- not the meta kernel's, which in torch 2.9 says float32 for float64 queries."""
    if not calls:
        return {}
    named = {r: bind(func, a, kw) for r, (a, kw) in calls.items()}
    first = next(iter(named.values()))

    def attend(q, k, v, causal, mask, scale):
        return func(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    merged = ring_forward(attend, {r: dict(n, mask=n["attn_mask"]) for r, n in named.items()}, ins,
                          first["is_causal"], first["scale"])
    return {r: (o.to(outs[0].dtype), l) for r, (o, l) in merged.items()}


def _ring_backward(func, ins, calls):
    if not calls:
        return {}
    named = {r: bind(func, a, kw) for r, (a, kw) in calls.items()}
    first = next(iter(named.values()))

    def attend_backward(grad_out, q, k, v, out, lse, causal, mask, scale):
        return func(grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)
    return ring_backward(attend_backward, {r: dict(n, mask=n["attn_mask"]) for r, n in named.items()}, ins,
                         first["is_causal"], first["scale"])


register_rule(_FWD, _forward_candidates, local=_local(_FWD, 0), kernel=_forward_kernel,
              kernel_bytes=attention_kernel_bytes(0), admit=admit_attention(0), any_order=_sequence_forward,
              keyed=DROPOUT)
register_rule(_BWD, _backward_candidates, local=_local(_BWD, 1), kernel=_backward_kernel,
              kernel_bytes=attention_kernel_bytes(1), admit=admit_attention(1), any_order=_sequence_backward,
              keyed=DROPOUT)
