"""CPU stand-ins for CUDA's sdpa kernels (flash, memory-efficient, cuDNN and their backwards), so that
ring attention on them (ops/rules/attention_cuda_ring.py) is tested on CPU before a GPU checks the
real kernels (tests/cuda).

While :func:`cuda_attention_on_cpu` is entered, each op has a CPU kernel that computes with the
CPU flash op and returns what the CUDA op returns, in its meta kernel's shapes and dtypes: the
log-sum-exp in float32 (``[B, H, L]`` for flash, padded to a multiple of 32 rows with ``+inf`` for
memory-efficient -- a ring reading a padding row would show it --, ``[B, H, L, 1]`` for cuDNN in
this torch), the bookkeeping as zeros, ``max_q`` / ``max_k`` as the call's lengths. Like the CUDA
kernels, ``is_causal`` is top-left aligned, flash takes no bias, dropout must be 0, and the
backwards read only the log-sum-exp's rows.
"""
from __future__ import annotations

import contextlib

import torch

aten = torch.ops.aten
_cpu_forward = aten._scaled_dot_product_flash_attention_for_cpu.default
_cpu_backward = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _meta(a):
    return torch.empty(a.shape, dtype=a.dtype, device="meta") if isinstance(a, torch.Tensor) else a


def _meta_results(op, args, kwargs) -> list:
    return list(op(*[_meta(a) for a in args], **{k: _meta(a) for k, a in kwargs.items()}))


def _like_meta(meta_results: list, tensors: list) -> tuple:
    """The op's results in its meta kernel's structure: ``tensors`` first (the log-sum-exp fitted to
    the meta shape by the caller), the other tensor results zeros, the numbers as meta gives them."""
    results, n = [], 0
    for m in meta_results:
        if isinstance(m, torch.Tensor):
            results.append(tensors[n].to(m.dtype) if n < len(tensors) else torch.zeros(m.shape, dtype=m.dtype))
            n += 1
        else:
            results.append(m)
    return tuple(results)


def _fit_lse(lse: torch.Tensor, shape) -> torch.Tensor:
    """``[B, H, L]`` into the op's log-sum-exp shape: padding rows ``+inf``, or a trailing 1."""
    if len(shape) == 4:
        return lse.unsqueeze(-1)
    return torch.nn.functional.pad(lse, (0, shape[2] - lse.shape[2]), value=float("inf"))


def _rows(lse: torch.Tensor, length: int) -> torch.Tensor:
    return lse.reshape(lse.shape[:3]).narrow(2, 0, length)


def _forward(op, q, k, v, bias, causal, scale, args, kwargs):
    out, lse = _cpu_forward(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
    meta = _meta_results(op, args, kwargs)
    return _like_meta(meta, [out, _fit_lse(lse, meta[1].shape)])


def _backward(op, grad, q, k, v, out, lse, bias, causal, scale, args, kwargs):
    grads = _cpu_backward(grad, q, k, v, out, _rows(lse, q.shape[2]).to(q.dtype), 0.0, causal, attn_mask=bias,
                          scale=scale)
    return _like_meta(_meta_results(op, args, kwargs), list(grads))


def _flash(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    assert dropout_p == 0 and not return_debug_mask
    return _forward(aten._scaled_dot_product_flash_attention.default, q, k, v, None, is_causal, scale,
                    (q, k, v, dropout_p, is_causal, return_debug_mask), {"scale": scale})


def _flash_backward(grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset, *,
                    scale=None):
    assert dropout_p == 0 and (max_q, max_k) == (q.shape[2], k.shape[2])
    args = (grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset)
    return _backward(aten._scaled_dot_product_flash_attention_backward.default, grad, q, k, v, out, lse, None,
                     is_causal, scale, args, {"scale": scale})


def _efficient(q, k, v, bias, compute_lse, dropout_p=0.0, is_causal=False, *, scale=None):
    assert dropout_p == 0 and compute_lse
    return _forward(aten._scaled_dot_product_efficient_attention.default, q, k, v, bias, is_causal, scale,
                    (q, k, v, bias, compute_lse, dropout_p, is_causal), {"scale": scale})


def _efficient_backward(grad, q, k, v, bias, out, lse, seed, offset, dropout_p, grad_input_mask, is_causal=False,
                        *, scale=None):
    assert dropout_p == 0 and not grad_input_mask[3] and lse.shape[2] % 32 == 0
    args = (grad, q, k, v, bias, out, lse, seed, offset, dropout_p, grad_input_mask, is_causal)
    return _backward(aten._scaled_dot_product_efficient_attention_backward.default, grad, q, k, v, out, lse, bias,
                     is_causal, scale, args, {"scale": scale})


def _cudnn(q, k, v, bias, compute_lse, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    assert dropout_p == 0 and compute_lse and not return_debug_mask
    return _forward(aten._scaled_dot_product_cudnn_attention.default, q, k, v, bias, is_causal, scale,
                    (q, k, v, bias, compute_lse, dropout_p, is_causal, return_debug_mask), {"scale": scale})


def _cudnn_backward(grad, q, k, v, out, lse, seed, offset, bias, cum_q, cum_k, max_q, max_k, dropout_p, is_causal,
                    *, scale=None):
    assert dropout_p == 0 and (max_q, max_k) == (q.shape[2], k.shape[2])
    args = (grad, q, k, v, out, lse, seed, offset, bias, cum_q, cum_k, max_q, max_k, dropout_p, is_causal)
    return _backward(aten._scaled_dot_product_cudnn_attention_backward.default, grad, q, k, v, out, lse, bias,
                     is_causal, scale, args, {"scale": scale})


_STANDINS = {
    "_scaled_dot_product_flash_attention": _flash,
    "_scaled_dot_product_flash_attention_backward": _flash_backward,
    "_scaled_dot_product_efficient_attention": _efficient,
    "_scaled_dot_product_efficient_attention_backward": _efficient_backward,
    "_scaled_dot_product_cudnn_attention": _cudnn,
    "_scaled_dot_product_cudnn_attention_backward": _cudnn_backward,
}


@contextlib.contextmanager
def cuda_attention_on_cpu():
    """The stand-ins registered as the ops' CPU kernels for the block's duration."""
    library = torch.library.Library("aten", "IMPL")
    try:
        for name, kernel in _STANDINS.items():
            library.impl(name, kernel, "CPU")
        yield
    finally:
        library._destroy()
