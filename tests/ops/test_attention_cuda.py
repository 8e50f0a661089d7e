"""The CUDA attention kernels' rules (ops/rules/attention_cuda.py), chosen on CPU with meta pieces.

The flash, memory-efficient and cuDNN ops have meta kernels on every build, so their signatures,
boxing and output layouts are decided and run here on global tensors whose pieces are meta tensors
(no values). Their values are checked against one device in the CUDA lane (tests/cuda)."""
from __future__ import annotations

import pytest
import torch

import globaltensor as gt
from globaltensor.boxing import Layout
from globaltensor.tensor import GlobalTensor
from fallback_guard import no_fallback

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
aten = torch.ops.aten
EFFICIENT = aten._scaled_dot_product_efficient_attention.default
FLASH = aten._scaled_dot_product_flash_attention.default
CUDNN = aten._scaled_dot_product_cudnn_attention.default


def meta_global(placement, shape, sbp, dtype=torch.float16) -> GlobalTensor:
    layout = Layout(tuple(shape), dtype, placement, (sbp,))
    return GlobalTensor(layout, {r: torch.empty(layout.piece_shape(r), dtype=dtype, device="meta")
                                 for r in placement.rank_list()})


def _meta_whole(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, GlobalTensor) else t


def _run(op, *args):
    """The op on global meta tensors, beside its meta kernel on the whole shapes."""
    with no_fallback():
        got = op(*args)
    want = op(*[_meta_whole(a) for a in args])
    for g, w in zip(got, want):
        if isinstance(w, torch.Tensor):
            assert tuple(g.shape) == tuple(w.shape) and g.dtype == w.dtype
        else:
            assert g == w
    return got


def _forward(op, q, k, v, bias=None):
    if op is FLASH:
        return _run(op, q, k, v, 0.0, False)
    return _run(op, q, k, v, bias, True, 0.0, False)


def _backward(op, out, q, k, v, bias=None, grad_bias=False):
    g = out[0]
    if op is EFFICIENT:
        return _run(aten._scaled_dot_product_efficient_attention_backward.default, g, q, k, v, bias, out[0], out[1],
                    out[2], out[3], 0.0, [True, True, True, grad_bias], False)
    if op is FLASH:
        return _run(aten._scaled_dot_product_flash_attention_backward.default, g, q, k, v, out[0], out[1], out[2],
                    out[3], out[4], out[5], 0.0, False, out[6], out[7])
    return _run(aten._scaled_dot_product_cudnn_attention_backward.default, g, q, k, v, out[0], out[1], out[6],
                out[7], bias, out[2], out[3], out[4], out[5], 0.0, False)


OPS = [EFFICIENT, FLASH, CUDNN]


@pytest.mark.parametrize("sbp", [S(0), S(1)], ids=["batch", "heads"])
@pytest.mark.parametrize("op", OPS, ids=lambda op: op.overloadpacket.__name__)
def test_batch_and_head_splits_keep_their_split(p1, op, sbp):
    q, k, v = (meta_global(p1, (6, 8, 16, 32), sbp) for _ in range(3))
    with gt.comm_stats() as st:
        out = _forward(op, q, k, v)
        grads = _backward(op, out, q, k, v)
    assert st.bytes_sent == 0
    assert out[0].sbp == (sbp,) and out[1].sbp == (sbp,)                  # output, log-sum-exp
    assert all(o.sbp == (B,) for o in out[2:] if isinstance(o, GlobalTensor))   # RNG state, placeholders
    assert [g.sbp for g in grads if g is not None] == [(sbp,)] * 3


@pytest.mark.parametrize("op", [EFFICIENT, FLASH], ids=lambda op: op.overloadpacket.__name__)
def test_grouped_query_attention_keeps_the_batch_split_only(p1, op):
    """(The cuDNN kernel takes no grouped-query attention.)"""
    q = meta_global(p1, (4, 8, 16, 32), S(1))
    k, v = (meta_global(p1, (4, 2, 16, 32), S(1)) for _ in range(2))
    out = _forward(op, q, k, v)
    assert out[0].sbp in ((S(0),), (B,))


def test_a_bias_without_the_batch_dim_stays_broadcast_and_its_gradient_is_partial(p1):
    q, k, v = (meta_global(p1, (8, 4, 16, 32), S(0)) for _ in range(3))
    bias = meta_global(p1, (1, 4, 16, 16), B)
    out = _forward(EFFICIENT, q, k, v, bias)
    assert out[0].sbp == (S(0),)
    grads = _backward(EFFICIENT, out, q, k, v, bias, grad_bias=True)
    assert [g.sbp for g in grads[:3]] == [(S(0),)] * 3


def test_a_batch_split_bias_is_split_with_the_batch(p1):
    q, k, v = (meta_global(p1, (8, 4, 16, 32), S(0)) for _ in range(3))
    bias = meta_global(p1, (8, 4, 16, 16), S(0))
    with gt.comm_stats() as st:
        out = _forward(EFFICIENT, q, k, v, bias)
    assert st.bytes_sent == 0 and out[0].sbp == (S(0),)


def test_partial_output_gradient_gives_partial_gradients(p1):
    """The gradients are linear in ``grad_out``: ``(P, B, ...) -> (P, P, P)`` is a candidate, and runs."""
    from harness import forced_run
    from globaltensor.sbp.signature import NdSignature
    op = aten._scaled_dot_product_flash_attention_backward.default
    q, k, v = (meta_global(p1, (4, 4, 16, 32), B) for _ in range(3))
    out = _forward(FLASH, q, k, v)
    grad = meta_global(p1, (4, 4, 16, 32), P)
    args = (grad, q, k, v, out[0], out[1], out[2], out[3], out[4], out[5], 0.0, False, out[6], out[7])
    linear = NdSignature(((P,),) + ((B,),) * 7, ((P,),) * 3)
    run = forced_run(op, args, {}, linear)
    assert run is not None
    with gt.comm_stats() as st:
        grads = run(args, {})
    assert st.bytes_sent == 0 and [g.sbp for g in grads] == [(P,)] * 3


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.overloadpacket.__name__)
def test_dropout_inside_the_kernels_raises_naming_the_math_backend(p1, op):
    q, k, v = (meta_global(p1, (4, 4, 16, 32), S(0)) for _ in range(3))
    args = (q, k, v, 0.1, False) if op is FLASH else (q, k, v, None, True, 0.1, False)
    with pytest.raises(NotImplementedError, match="SDPBackend.MATH"):
        op(*args)
