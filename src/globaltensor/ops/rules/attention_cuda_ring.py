"""Ring attention (ring_attention.py) on CUDA's sdpa kernels: the flash, memory-efficient and cuDNN
ops as the ring's block kernels, their signature with q, k and v split on the sequence.

Each kernel is one block function for the forward and one for the backward, which hide how the
three ops differ:

- flash takes no mask (its ring runs only ``is_causal`` or nothing, which ring_attention.py cuts
  into masks-free blocks anyway) and returns its log-sum-exp as ``[B, H, L]``;
- memory-efficient takes an additive ``attn_bias`` and pads its log-sum-exp to a multiple of 32
  rows (``[B, H, ceil(L / 32) * 32]``): its ring is a signature only where the query length is a
  multiple of 32, so that the padded global log-sum-exp splits as the queries do; each block's
  is cut to its rows, and padded again for the block's backward;
- cuDNN takes an ``attn_bias`` and returns its log-sum-exp as ``[B, H, L, 1]`` in this torch (the
  meta kernel says which): squeezed for the merge, restored for the result and the backward.

A block's bias is copied into a buffer whose rows are padded to 16 elements (the alignment the
memory-efficient kernel asks of a bias, as sdpa's own preprocessing gives it), broadcast dims kept.
Every block operand is made contiguous (a head-tail range is a strided view).

The ops' other results are bookkeeping: the sequence lengths ``max_q`` / ``max_k`` (the global
ones, as one device's call returns) and the dropout RNG's seed and offset, which only dropout reads
-- and these rules refuse dropout (attention_cuda.py) -- so a ring returns them as zeros.
"""
from __future__ import annotations

from typing import List

import torch

from ...boxing import Layout
from ..registry import aten
from .common import B, S, bind, sig, tensors_of
from .ring_attention import ring_backward, ring_forward

_FLASH = aten._scaled_dot_product_flash_attention.default
_EFFICIENT = aten._scaled_dot_product_efficient_attention.default
_CUDNN = aten._scaled_dot_product_cudnn_attention.default
_BACKWARD_OF = {
    aten._scaled_dot_product_flash_attention_backward.default: _FLASH,
    aten._scaled_dot_product_efficient_attention_backward.default: _EFFICIENT,
    aten._scaled_dot_product_cudnn_attention_backward.default: _CUDNN,
}
_SEQUENCE = ("grad_out", "grad_out_", "query", "key", "value", "out", "logsumexp")


def _bias_sbp(bias: torch.Tensor, length: int):
    """A bias broadcast against ``[B, H, L, S]``: split on its query dim where it has it, else ``B``."""
    k = bias.dim() - 2
    return S(k) if k >= 0 and bias.shape[k] == length and length != 1 else B


def _layout_inputs(op, args, kwargs) -> list:
    """The ring's input SBPs: the sequence-shaped operands ``S(2)``, a bias by its query dim, the
    bookkeeping (RNG seed and offset) ``B``."""
    named = bind(op, args, kwargs)
    length = named["query"].shape[2]
    by_id = {id(named[n]): S(2) for n in _SEQUENCE if isinstance(named.get(n), torch.Tensor)}
    bias = named.get("attn_bias")
    if isinstance(bias, torch.Tensor):
        by_id[id(bias)] = _bias_sbp(bias, length)
    return [by_id.get(id(t), B) for t in tensors_of(*args, **kwargs)]


def ring_forward_candidates(op, args, kwargs, results: list) -> list:
    """The forward's ring signature: out and log-sum-exp ``S(2)``, the bookkeeping ``B``; none where
    the log-sum-exp's rows are not the queries' (the memory-efficient kernel's padding)."""
    length = bind(op, args, kwargs)["query"].shape[2]
    tensors = [r for r in results if isinstance(r, torch.Tensor)]
    if tensors[1].shape[2] not in (length, 0):
        return []
    return [sig(_layout_inputs(op, args, kwargs), [S(2), S(2)] + [B] * (len(tensors) - 2))]


def ring_backward_candidates(op, args, kwargs, results: list) -> list:
    """The backward's: the three gradients ``S(2)``; none where it returns a bias gradient, or where the
    log-sum-exp's rows are not the queries'."""
    named = bind(op, args, kwargs)
    tensors = [r for r in results if isinstance(r, torch.Tensor)]
    if len(tensors) != 3 or named["logsumexp"].shape[2] != named["query"].shape[2]:
        return []
    return [sig(_layout_inputs(op, args, kwargs), [S(2)] * 3)]


def _aligned_bias(bias, q, k):
    """The block's bias in a buffer with rows padded to 16 elements, broadcast dims kept, expanded to
    ``[B, H, rows, keys]``; None without one."""
    if bias is None:
        return None
    while bias.dim() < 4:
        bias = bias.unsqueeze(0)
    keys = bias.shape[-1]
    buffer = bias.new_empty(bias.shape[:-1] + (-(-keys // 16) * 16,))
    block = buffer.narrow(-1, 0, keys)
    block.copy_(bias)
    return block.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _flash(q, k, v, causal, bias, scale):
    r = _FLASH(q, k, v, 0.0, causal, False, scale=scale)
    return r[0], r[1]


def _efficient(q, k, v, causal, bias, scale):
    r = _EFFICIENT(q, k, v, _aligned_bias(bias, q, k), True, 0.0, causal, scale=scale)
    return r[0], r[1].narrow(2, 0, q.shape[2])


def _cudnn(q, k, v, causal, bias, scale):
    r = _CUDNN(q, k, v, _aligned_bias(bias, q, k), True, 0.0, causal, False, scale=scale)
    return r[0], r[1].reshape(r[1].shape[:3])


_ATTEND = {_FLASH: _flash, _EFFICIENT: _efficient, _CUDNN: _cudnn}


def _attend_backward(op, named: dict, lse_dims: int):
    """The backward op on one block, its RNG bookkeeping (unread without dropout) the call's own."""
    seed, offset = named.get("philox_seed"), named.get("philox_offset")
    forward = _BACKWARD_OF[op]

    def attend_backward(grad_out, q, k, v, out, lse, causal, bias, scale):
        grad_out, q, k, v, out, lse = (t.contiguous() for t in (grad_out, q, k, v, out, lse))
        if forward is _FLASH:
            return op(grad_out, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, seed, offset,
                      scale=scale)
        if forward is _EFFICIENT:
            padded = torch.nn.functional.pad(lse, (0, -q.shape[2] % 32))
            return op(grad_out, q, k, v, _aligned_bias(bias, q, k), out, padded, seed, offset, 0.0,
                      [True, True, True, False], causal, scale=scale)[:3]
        lse = lse.unsqueeze(-1) if lse_dims == 4 else lse
        return op(grad_out, q, k, v, out, lse, seed, offset, _aligned_bias(bias, q, k), None, None, q.shape[2],
                  k.shape[2], 0.0, causal, scale=scale)
    return attend_backward


def _contiguous_blocks(attend):
    def run(q, k, v, causal, bias, scale):
        return attend(q.contiguous(), k.contiguous(), v.contiguous(), causal, bias, scale)
    return run


def _global_results(func, args, kwargs) -> list:
    """The op's results for the global call, from its meta kernel: their structure, and the numbers
    (``max_q``, ``max_k``) one device's call returns."""
    def meta(a):
        return torch.empty(a.shape, dtype=a.dtype, device="meta") if isinstance(a, torch.Tensor) else a
    return list(func(*[meta(a) for a in args], **{n: meta(a) for n, a in kwargs.items()}))


def _pieces_like(results: list, tensors: list, outs: List[Layout], rank: int, device) -> tuple:
    """One rank's results in the op's structure: its first tensors ``tensors``, the other tensor
    results zeros of their pieces' shapes (bookkeeping), the rest as the global call's."""
    pieces, n = [], 0
    for r in results:
        if isinstance(r, torch.Tensor):
            pieces.append(tensors[n] if n < len(tensors) else
                          torch.zeros(outs[n].piece_shape(rank), dtype=outs[n].dtype, device=device))
            n += 1
        else:
            pieces.append(r)
    return tuple(pieces)


def ring_forward_kernel(func, args, kwargs, ins, outs, calls) -> dict:
    """Ring attention with the CUDA op ``func`` as the block kernel; its results in the op's structure."""
    if not calls:
        return {}
    named = {r: bind(func, a, kw) for r, (a, kw) in calls.items()}
    first = next(iter(named.values()))
    merged = ring_forward(_contiguous_blocks(_ATTEND[func]),
                          {r: dict(n, mask=n.get("attn_bias")) for r, n in named.items()}, ins,
                          first["is_causal"], first["scale"])
    results = _global_results(func, args, kwargs)
    lse_layout = outs[1]
    out = {}
    for r, (o, l) in merged.items():
        lse = l.reshape(lse_layout.piece_shape(r)) if lse_layout.piece_shape(r)[2] else \
            l.new_empty(lse_layout.piece_shape(r))
        out[r] = _pieces_like(results, [o.to(outs[0].dtype), lse.to(lse_layout.dtype)], outs, r, o.device)
    return out


def ring_backward_kernel(func, args, kwargs, ins, outs, calls) -> dict:
    """The backward's ring; its results (the three gradients, a bias gradient not asked for) in the
    op's structure."""
    if not calls:
        return {}
    named = {r: bind(func, a, kw) for r, (a, kw) in calls.items()}
    first = next(iter(named.values()))
    lse_dims = first["logsumexp"].dim()
    pieces = {r: dict(n, grad_out=n.get("grad_out", n.get("grad_out_")), mask=n.get("attn_bias"),
                      logsumexp=n["logsumexp"].reshape(n["logsumexp"].shape[:3])) for r, n in named.items()}
    grads = ring_backward(_attend_backward(func, first, lse_dims), pieces, ins, first["is_causal"], first["scale"])
    results = _global_results(func, args, kwargs)
    return {r: _pieces_like(results, list(g), outs, r, g[0].device) for r, g in grads.items()}
