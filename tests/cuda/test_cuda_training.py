"""The CUDA lane's training checks (skipped without a GPU): the 2x2 GPT of examples/gpt.py on a cuda
placement (4 simulated ranks on cuda:0) against the same model on one GPU, eager and compiled, in
float64; the foreach and fused optimizer paths and GradScaler on CUDA; attention's CUDA kernels.

float64 tolerances are training_helpers.TOL's (sums in another order); the fused kernels on pieces
are compared as tests/training/test_fused_optimizers.py explains."""
from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import globaltensor as gt
import globaltensor.nn as gnn
from globaltensor.tensor import GlobalTensor
from fallback_guard import no_fallback
from local_calls import LocalCalls

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
from training_helpers import BATCH, CFG, SEQ, TOL, GPT, default_dtype, make_batch, megatron, train_step  # noqa: E402

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum


@pytest.fixture
def cuda22():
    with gt.simulate(4):
        yield gt.placement("cuda", [[0, 1], [2, 3]])


def _gpt_pair(placement, optimizer):
    torch.manual_seed(0)
    with default_dtype(torch.float64):
        reference = GPT(CFG).cuda()
    model = copy.deepcopy(reference)
    gnn.distribute_module(model, placement, megatron(axis=1, ndim=2))
    cls, kw = optimizer
    return model, reference, cls(model.parameters(), **kw), cls(reference.parameters(), **kw)


OPTIMIZERS = {"foreach": (torch.optim.AdamW, dict(lr=1e-2, eps=1e-6)),
              "fused": (torch.optim.AdamW, dict(lr=1e-2, eps=1e-6, fused=True))}


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("mode", ["eager", "compiled", "cuda_graphs"])
def test_gpt_on_a_cuda_placement_trains_as_one_gpu(cuda22, opt, mode):
    """With ``cuda_graphs=True`` the steps run past every register slot's capture into replays (an eager
    warm-up call, then per slot an eager iteration, a capture, replays), and no segment falls back."""
    model, reference, optimizer, ref_opt = _gpt_pair(cuda22, OPTIMIZERS[opt])
    step = train_step(model, optimizer)
    step = step if mode == "eager" else gt.compile(step, cuda_graphs=mode == "cuda_graphs")
    ref_step = train_step(reference, ref_opt)
    data = torch.Generator().manual_seed(1)
    with default_dtype(torch.float64), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(8 if mode == "cuda_graphs" else 4):
            idx, targets = (t.cuda() for t in make_batch(CFG, BATCH, SEQ, data))
            loss = step(gt.distribute(idx, cuda22, (S(0), B)), gt.distribute(targets, cuda22, (S(0), B)))
            torch.testing.assert_close(loss.full_tensor(), ref_step(idx, targets), **TOL)
    assert not [w for w in caught if "could not be captured" in str(w.message)], [str(w.message) for w in caught]
    if mode == "cuda_graphs":
        assert any(seg.capturable for seg in step.plan.segments)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.device.type == "cuda"
        torch.testing.assert_close(p.full_tensor(), q.detach(), **TOL, msg=name)


def test_optimizer_step_is_one_call_per_group_on_cuda(cuda22):
    model, _, optimizer, _ = _gpt_pair(cuda22, (torch.optim.AdamW, dict(lr=1e-2)))   # torch's CUDA default: foreach
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with LocalCalls() as seen:
        optimizer.step()
    groups = len({(p.placement, p.dtype) for p in model.parameters()})
    assert seen.count("_foreach_lerp_") == groups


@pytest.mark.parametrize("inf", [False, True], ids=["finite", "inf-on-one-rank"])
def test_grad_scaler_on_cuda(inf):
    with gt.simulate(4):
        p1 = gt.placement("cuda", [0, 1, 2, 3])
        w0 = torch.randn(10, 6, device="cuda")
        sides = []
        for glob in (False, True):
            w = (gt.distribute(w0.clone(), p1, S(0)) if glob else w0.clone()).requires_grad_()
            opt = torch.optim.AdamW([w], lr=0.05, fused=True)
            scaler = torch.amp.GradScaler("cuda", init_scale=1024.0)
            for step in range(3):
                g = torch.full((10, 6), 1024.0, device="cuda")
                if inf and step == 1:
                    g[9, 0] = float("inf")                   # the last rank's rows only
                opt.zero_grad()
                scaler.scale(torch.zeros((), device="cuda"))
                w.grad = gt.distribute(g, p1, S(0)) if glob else g
                scaler.step(opt)
                scaler.update()
            sides.append((w, scaler.get_scale()))
        (plain, s0), (glob, s1) = sides
        assert s0 == s1
        torch.testing.assert_close(glob.full_tensor(), plain.detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype,backend", [(torch.float16, "FLASH_ATTENTION"), (torch.float32, "EFFICIENT_ATTENTION"),
                                           (torch.bfloat16, "CUDNN_ATTENTION")])
@pytest.mark.parametrize("sbp", [S(0), S(1)], ids=["batch", "heads"])
def test_sdpa_kernels_on_a_cuda_placement(dtype, backend, sbp):
    """The kernel's own arithmetic on each (batch, head) pair: equal to one GPU up to the kernel's
    nondeterminism between launches of other shapes (~1 ulp of the dtype per output, 1e-2 for half)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with gt.simulate(4):
        p1 = gt.placement("cuda", [0, 1, 2, 3])
        q, k, v = (torch.randn(4, 8, 64, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
        gq, gk, gv = (gt.distribute(t.detach(), p1, sbp).requires_grad_() for t in (q, k, v))
        with sdpa_kernel(getattr(SDPBackend, backend)):
            want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            with no_fallback():
                got = F.scaled_dot_product_attention(gq, gk, gv, is_causal=True)
                got.sum().backward()
            want.sum().backward()
        tol = dict(rtol=1e-2, atol=1e-2) if dtype != torch.float32 else dict(rtol=1e-5, atol=1e-5)
        assert isinstance(got, GlobalTensor) and got.sbp == (sbp,)
        torch.testing.assert_close(got.full_tensor(), want, **tol)
        for g, t in ((gq, q), (gk, k), (gv, v)):
            torch.testing.assert_close(g.grad.full_tensor(), t.grad, **tol)


@pytest.mark.parametrize("dtype,backend", [(torch.float16, "FLASH_ATTENTION"), (torch.float32, "EFFICIENT_ATTENTION"),
                                           (torch.bfloat16, "CUDNN_ATTENTION")])
@pytest.mark.parametrize("order", ["plain", "head_tail"])
def test_ring_attention_on_the_cuda_kernels(dtype, backend, order):
    """q, k and v split on the sequence: the kernel runs each block of the ring (ring_attention.py),
    only key/value blocks move, and the result equals one GPU's call -- up to the blocks' own
    rounding in the dtype (the merge and the gradients' sums run in float32: 1e-2 for half, 1e-4
    for float32, whose kernels sum in another order)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with gt.simulate(4):
        p1 = gt.placement("cuda", [0, 1, 2, 3])
        seq = S(2, order=order)
        q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
        gq, gk, gv = (gt.distribute(t.detach(), p1, seq).requires_grad_() for t in (q, k, v))
        with sdpa_kernel(getattr(SDPBackend, backend)):
            want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            with no_fallback(), gt.explicit(), gt.comm_stats() as stats:
                got = F.scaled_dot_product_attention(gq, gk, gv, is_causal=True)
                got.sum().backward()
            want.sum().backward()
        tol = dict(rtol=1e-2, atol=1e-2) if dtype != torch.float32 else dict(rtol=1e-4, atol=1e-4)
        assert got.sbp == (seq,) and set(stats.ops()) == {"send_recv"}, stats.ops()
        torch.testing.assert_close(got.full_tensor(), want, **tol)
        for g, t in ((gq, q), (gk, k), (gv, v)):
            torch.testing.assert_close(g.grad.full_tensor(), t.grad, **tol)


@pytest.mark.parametrize("backend", ["EFFICIENT_ATTENTION", "CUDNN_ATTENTION"])
def test_ring_attention_cuts_a_mask_per_block_on_the_cuda_kernels(backend):
    """An additive mask split on its query rows: each block hands the kernel its key columns, copied
    into a buffer aligned as the kernel asks (attention_cuda_ring.py); equal to one GPU's call."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    dtype = torch.float32 if backend == "EFFICIENT_ATTENTION" else torch.bfloat16
    with gt.simulate(4):
        p1 = gt.placement("cuda", [0, 1, 2, 3])
        q, k, v = (torch.randn(2, 4, 128, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
        mask = torch.randn(2, 1, 128, 128, device="cuda", dtype=dtype)
        mask[..., 100:] = -float("inf")                     # padded keys, hidden from every row
        gq, gk, gv = (gt.distribute(t.detach(), p1, S(2)).requires_grad_() for t in (q, k, v))
        gmask = gt.distribute(mask, p1, S(2))
        with sdpa_kernel(getattr(SDPBackend, backend)):
            want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            with no_fallback(), gt.explicit():
                got = F.scaled_dot_product_attention(gq, gk, gv, attn_mask=gmask)
                got.sum().backward()
            want.sum().backward()
        tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(got.full_tensor(), want, **tol)
        for g, t in ((gq, q), (gk, k), (gv, v)):
            torch.testing.assert_close(g.grad.full_tensor(), t.grad, **tol)


def test_cpu_and_cuda_placements_box_into_each_other():
    with gt.simulate(4):
        x = torch.randn(8, 6, dtype=torch.float64)
        for src, dst in [(gt.placement("cpu", [0, 1]), gt.placement("cuda", [1, 2, 3])),
                         (gt.placement("cuda", [[0, 1], [2, 3]]), gt.placement("cpu", [3, 0]))]:
            a = gt.distribute(x.to(src.type), src, (S(0),) * src.ndim)
            b = a.to_global(placement=dst, sbp=(S(1),) * dst.ndim)
            assert b.device.type == dst.type
            torch.testing.assert_close(b.full_tensor().cpu(), x, rtol=0, atol=0)
