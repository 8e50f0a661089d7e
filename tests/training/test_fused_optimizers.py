"""Fused optimizers (``fused=True``) on global parameters of every layout equal one device's step.

The gradients are given (the same values on both sides) rather than computed, so the update is the
only computation compared. It is elementwise, and each rank runs torch's own fused kernel on its
pieces; so every piece equals, bit for bit, the same kernel run by plain torch on that piece alone
(``PIECEWISE``: the test's second reference). Against the kernel run on each whole tensor the
pieces may differ in the last bits: torch's CPU kernels compute a vector-width body and a scalar
tail with different instruction sequences (fused multiply-adds or not), and a piece boundary moves
elements between the two (seen: 1 ulp on 4 of 72 elements of a float64 Adam step). Each step's
update then differs by at most ~8 roundings of the quantities it combines, each <= u (2**-53,
2**-24) relative; through 3 steps and the states that carry them, <= 24 u of the largest magnitude
involved (parameter or state), so ``WHOLE`` allows 32 u of that scale."""
from __future__ import annotations

import pytest
import torch

import globaltensor as gt
import globaltensor.nn as gnn
from globaltensor.tensor import GlobalTensor

from local_calls import LocalCalls

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
EXACT = dict(rtol=0, atol=0)

OPTIMIZERS = {
    "adam": (torch.optim.Adam, dict(lr=0.05, eps=1e-6, weight_decay=0.01)),
    "adam-amsgrad": (torch.optim.Adam, dict(lr=0.05, amsgrad=True)),
    "adamw": (torch.optim.AdamW, dict(lr=0.05, weight_decay=0.1)),
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "adagrad": (torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.01)),
}
SHAPES = [(12, 6), (10,), (6, 10)]          # uneven over 4 ranks; 12 rows: 3 blocks of 4


def _layouts(name: str, placement):
    """The nd-SBP of each parameter for a named layout."""
    return {
        "S(0)": [S(0), S(0), S(0)],
        "S(1)": [S(1), S(0), S(1)],
        "B": [B, B, B],
        "2x2 (B, S(1))": [(B, S(1)), (B, S(0)), (B, S(1))],
        "blocked": [S(0, blocks=3), B, S(1)],
        "mixed": [S(1), B, S(0)],
    }[name]


def _grads(step: int, dtype):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, dtype=dtype, generator=g) for s in SHAPES]


def _run(params, make_opt, dtype, steps=3, grads=None):
    opt = make_opt(params)
    for step in range(steps):
        for p, g in zip(params, grads(step) if grads else _grads(step, dtype)):
            p.grad = gt.distribute(g, p.placement, p.sbp) if isinstance(p, GlobalTensor) else g
        opt.step()
    return opt


def _whole_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within 32 u of the tensor's scale (see the module's docstring)."""
    scale = max(float(want.abs().max()) if want.numel() else 0.0, 1.0)
    torch.testing.assert_close(got, want, rtol=0, atol=32 * torch.finfo(want.dtype).eps * scale)


def _piecewise_reference(glob, cls, kw, dtype):
    """Plain torch's fused step over every rank's pieces, as separate plain tensors: ``{(param, rank):
    (piece, optimizer)}`` after the same steps."""
    pieces = [(i, r, p.to_local(rank=r).detach().clone().requires_grad_()) for i, p in enumerate(glob)
              for r in p.local_tensors()]

    def piece_grads(step):
        whole = _grads(step, dtype)
        return [gt.distribute(whole[i], glob[i].placement, glob[i].sbp).to_local(rank=r) for i, r, _ in pieces]
    opt = _run([t for _, _, t in pieces], lambda ps: cls(ps, fused=True, **kw), dtype, grads=piece_grads)
    return {(i, r): (t, opt) for i, r, t in pieces}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("layout", ["S(0)", "S(1)", "B", "2x2 (B, S(1))", "blocked", "mixed"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fused_step_equals_one_device(world4, name, layout, dtype):
    cls, kw = OPTIMIZERS[name]
    placement = gt.placement("cpu", [[0, 1], [2, 3]] if layout.startswith("2x2") else [0, 1, 2, 3])
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(s, dtype=dtype, generator=g) for s in SHAPES]
    plain = [v.clone().requires_grad_() for v in values]
    glob = [gt.distribute(v.clone(), placement, sbp).requires_grad_()
            for v, sbp in zip(values, _layouts(layout, placement))]
    pieces = _piecewise_reference([gt.distribute(v.clone(), placement, sbp) for v, sbp in
                                   zip(values, _layouts(layout, placement))], cls, kw, dtype)
    ref = _run(plain, lambda ps: cls(ps, fused=True, **kw), dtype)
    opt = _run(glob, lambda ps: cls(ps, fused=True, **kw), dtype)
    for i, (p, want) in enumerate(zip(glob, plain)):
        _whole_close(p.full_tensor(), want.detach())
        for r, piece in p.local_tensors().items():
            torch.testing.assert_close(piece, pieces[i, r][0].detach(), **EXACT)
        for key, value in opt.state[p].items():
            if isinstance(value, GlobalTensor):
                assert value.sbp == p.sbp, key
                _whole_close(value.full_tensor(), ref.state[want][key])
                for r, piece in value.local_tensors().items():
                    plain_piece, plain_opt = pieces[i, r]
                    torch.testing.assert_close(piece, plain_opt.state[plain_piece][key], **EXACT)


def test_fused_step_is_one_call_per_group_with_no_gather(p1):
    params = [gt.distribute(torch.randn(s, dtype=torch.float64), p1, sbp).requires_grad_()
              for s, sbp in zip(SHAPES, [S(1), S(0), B])]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW(params, lr=0.1, fused=True)
    with LocalCalls() as seen, gt.comm_stats() as st:
        opt.step()
    assert seen.count("_fused_adamw_") == 1
    assert st.bytes_sent == 0


def test_fused_op_on_partial_gradients_writes_them_back_partial(p1):
    """With ``grad_scale`` the fused kernel unscales the gradients in place. A partial gradient is
    reduced for the update (Adam is not linear) and the unscaled value written back into its partial
    layout; the parameter is updated in its own."""
    w0, g0 = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    m0, v0 = torch.zeros_like(w0), torch.zeros_like(w0)
    step, scale, found = torch.tensor(1.0, dtype=torch.float64), torch.tensor(4.0), torch.tensor(0.0)
    kw = dict(lr=0.1, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False,
              grad_scale=scale, found_inf=found)
    want = [t.clone() for t in (w0, g0, m0, v0)]
    torch._fused_adam_([want[0]], [want[1]], [want[2]], [want[3]], [], [step], **kw)
    w, m, v = (gt.distribute(t.clone(), p1, S(0)) for t in (w0, m0, v0))
    g = gt.distribute(g0.clone(), p1, B).to_global(sbp=P) * 1.0
    torch._fused_adam_([w], [g], [m], [v], [], [step], **kw)
    assert g.sbp == (P,) and w.sbp == (S(0),)
    for got, ref in zip((w, g, m, v), want):
        _whole_close(got.full_tensor(), ref)


@pytest.mark.parametrize("name", ["adamw", "sgd", "adagrad"])
def test_zero_optimizer_with_a_fused_inner_optimizer(p2, name):
    """ZeroOptimizer splits the state over the data axis; its inner optimizer is fused."""
    cls, kw = OPTIMIZERS[name]
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(s, dtype=torch.float64, generator=g) for s in SHAPES]
    plain = [v.clone().requires_grad_() for v in values]
    glob = [gt.distribute(v.clone(), p2, sbp).requires_grad_() for v, sbp in zip(values, [(B, S(1)), (B, B), (B, S(0))])]
    _run(plain, lambda ps: cls(ps, fused=True, **kw), torch.float64)
    opt = _run(glob, lambda ps: gnn.ZeroOptimizer(ps, cls, axis=0, fused=True, **kw), torch.float64)
    for p, want in zip(glob, plain):
        _whole_close(p.full_tensor(), want.detach())
        shard = opt.shard_of(p)
        for value in opt.state[p].values():
            if isinstance(value, GlobalTensor) and value.dim():
                assert value.sbp == shard.sbp
