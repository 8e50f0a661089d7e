"""Scaled dot-product attention's CUDA kernels: the flash, memory-efficient and cuDNN ops and their
backwards -- what ``F.scaled_dot_product_attention`` reaches on a GPU (attention.py has the CPU op).

Their schemas differ but their tensors are of two kinds: ``[B, H, L or S, E]`` operands and results
(q, k, v, the output, its gradient, a bias / mask, the gradients), with the log-sum-exp ``[B, H,
...]`` beside them; and bookkeeping: the dropout RNG's seed and offset (``philox_seed``,
``philox_offset``, ``rng_state``), empty placeholders (``unused``, ``debug_attn_mask`` when not
asked for) and the sequence lengths ``max_q`` / ``max_k`` (numbers). Every (batch, head) pair
attends by itself, so per placement axis:

- batch split: every ``[B, H, ...]`` tensor ``S(0)`` (a bias broadcast over the batch stays ``B``,
  its gradient then a partial sum ``P``), the bookkeeping ``B``;
- head split: the same with ``S(1)``, only without grouped-query attention (``H == Hk``), as on CPU;
- backward with a partial ``grad_out`` (everything else ``B``): the gradients are linear in it, ``P``;
- sequence split (ring attention, attention_cuda_ring.py): q, k, v ``S(2)`` (a bias ``S`` on its
  query dim) -> output and log-sum-exp ``S(2)``; backward the gradients ``S(2)``. Not for the
  memory-efficient kernel where the query length is not a multiple of 32 (its log-sum-exp's
  padding would split unlike the queries).

No query split with k and v gathered: the memory-efficient kernel pads its log-sum-exp to a
multiple of 32 rows, and flash returns ``max_q`` per call -- per-piece quantities a split of the
rows would mix up (the ring computes them from the global shapes). A bias is split only where it
has the dim (size 1 or missing: ``B``). With ``dropout_p > 0`` the kernels
draw their masks from each rank's own CUDA generator: not sharding-invariant, and broadcast replicas
would each draw their own. Such a call raises, naming the way out: the math backend
(``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)``), whose dropout has a sharding-invariant rule.
``return_debug_mask=True`` has no candidate (it runs on broadcast copies).

The candidates are read off the op's own meta kernel: the rule runs the op on the meta arguments
and lays out each tensor result by its shape, so the bookkeeping results (which differ between the
three ops and between releases) need no table.
"""
from __future__ import annotations

import torch

from ...compat.torch_ops import exists
from ..registry import aten, register_rule
from .attention_cost import DROPOUT, attention_kernel_bytes, keeps_the_work_divided
from .attention_cuda_ring import (ring_backward_candidates, ring_backward_kernel, ring_forward_candidates,
                                  ring_forward_kernel)
from .common import B, P, S, bind, sig, tensors_of
from .ring_attention import seq_axes

_FORWARD = [aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_cudnn_attention.default]
_BACKWARD = {
    aten._scaled_dot_product_efficient_attention_backward.default: "grad_out_",
    aten._scaled_dot_product_flash_attention_backward.default: "grad_out",
    aten._scaled_dot_product_cudnn_attention_backward.default: "grad_out",
}


def _split_of(t: torch.Tensor, d: int, batch_heads: tuple, gradient: bool = False):
    """How tensor ``t`` takes a split of dim ``d`` (0: batch, 1: heads) of ``[B, H, ...]``: ``S(d)`` for a
    tensor with those leading dims, ``S(k)`` for a bias broadcast to ``[B, H, L, S]`` that has the dim;
    a bias's gradient that lacks it sums every rank's part (``P``); bookkeeping (RNG state, empty
    placeholders) ``B``."""
    if t.dim() >= 3 and tuple(t.shape[:2]) == batch_heads:
        return S(d)
    k = d - (4 - t.dim())
    if 2 <= t.dim() <= 4 and k >= 0 and t.shape[k] == batch_heads[d] and t.shape[k] != 1:
        return S(k)
    return P if gradient and t.dim() >= 2 else B


def _usable(op, named: dict) -> bool:
    if named.get("dropout_p", 0.0) != 0:
        raise NotImplementedError(
            f"globaltensor: {op} with dropout_p={named['dropout_p']} draws its dropout mask from each rank's CUDA "
            f"generator, which is not sharding-invariant; run attention with the math backend "
            f"(with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH): ...), whose dropout is, "
            f"or with dropout_p=0")
    return not named.get("return_debug_mask", False) and named["query"].dim() == 4


def _candidates(op, args, kwargs, results: list, gradients: bool) -> list:
    """Batch split, and head split without grouped-query attention: the inputs and the meta kernel's
    tensor results laid out by :func:`_split_of`."""
    named = bind(op, args, kwargs)
    q, k = named["query"], named["key"]
    bh = tuple(q.shape[:2])
    outs = [o for o in results if isinstance(o, torch.Tensor)]
    ins = tensors_of(*args, **kwargs)
    return [sig([_split_of(t, d, bh) for t in ins], [_split_of(o, d, bh, gradients) for o in outs])
            for d in ((0, 1) if q.shape[1] == k.shape[1] else (0,))]


def _forward(op):
    def rule(*args, **kwargs):
        if not _usable(op, bind(op, args, kwargs)):
            return []
        results = list(op(*args, **kwargs))
        return _candidates(op, args, kwargs, results, False) + ring_forward_candidates(op, args, kwargs, results)
    return rule


def _ring_only(op, ring_candidates):
    """The rule's head-tail candidates: the ring signature alone (it reads the chunks' positions)."""
    def rule(*args, **kwargs):
        if not _usable(op, bind(op, args, kwargs)):
            return []
        return ring_candidates(op, args, kwargs, list(op(*args, **kwargs)))
    return rule


def _backward(op, grad_name):
    def rule(*args, **kwargs):
        named = bind(op, args, kwargs)
        if not _usable(op, named):
            return []
        ins = tensors_of(*args, **kwargs)
        results = list(op(*args, **kwargs))
        n_out = sum(isinstance(o, torch.Tensor) for o in results)
        linear = sig([P if t is named[grad_name] else B for t in ins], [P] * n_out)
        return (_candidates(op, args, kwargs, results, True) + [linear] +
                ring_backward_candidates(op, args, kwargs, results))
    return rule


def _kernel(ring_kernel, q_index):
    """Ring attention where k is split on the sequence; otherwise the op on each rank's pieces."""
    def kernel(func, args, kwargs, ins, outs, calls):
        if seq_axes(ins[q_index + 1]):
            return ring_kernel(func, args, kwargs, ins, outs, calls)
        return {r: func(*a, **kw) for r, (a, kw) in calls.items()}
    return kernel


for _op in _FORWARD:
    if exists(_op):
        register_rule(_op, _forward(_op), kernel=_kernel(ring_forward_kernel, 0), kernel_bytes=attention_kernel_bytes(0),
                      admit=keeps_the_work_divided(0), any_order=_ring_only(_op, ring_forward_candidates),
                      keyed=DROPOUT)
for _op, _grad in _BACKWARD.items():
    if exists(_op):
        register_rule(_op, _backward(_op, _grad), kernel=_kernel(ring_backward_kernel, 1),
                      kernel_bytes=attention_kernel_bytes(1), admit=keeps_the_work_divided(1),
                      any_order=_ring_only(_op, ring_backward_candidates), keyed=DROPOUT)
