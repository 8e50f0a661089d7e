"""Mixed precision on global tensors at one device's semantics: ``torch.amp.GradScaler`` (its unscale and
skip decision), ``torch.autocast`` with a tensor-parallel model, and both compiled with ``gt.compile``.

GradScaler's gradients are given (scaled by a power of two, so scaling and unscaling are exact) and
the steps compared exactly where the update is one elementwise kernel per piece (SGD's
``_foreach_add_``); the fused AdamW step is compared as test_fused_optimizers.py explains."""
from __future__ import annotations

import copy

import pytest
import torch

import globaltensor as gt
import globaltensor.nn as gnn
from globaltensor.tensor import GlobalTensor

from training_helpers import BATCH, CFG, GPT, SEQ, make_batch, megatron

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
EXACT = dict(rtol=0, atol=0)
SHAPES = [(10, 6), (6,)]
SCALE = 1024.0


def _params(placement, sbps, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(s, dtype=dtype, generator=g) for s in SHAPES]
    plain = [v.clone().requires_grad_() for v in values]
    glob = [gt.distribute(v.clone(), placement, sbp).requires_grad_() for v, sbp in zip(values, sbps)]
    return plain, glob


def _scaled_step(params, opt, scaler, step: int, inf_at=None):
    """One GradScaler step with gradients ``SCALE`` times a fixed draw; ``inf_at`` (row) puts an inf
    into the first gradient there."""
    g = torch.Generator().manual_seed(10 + step)
    grads = [torch.randn(s, dtype=params[0].dtype, generator=g) * SCALE for s in SHAPES]
    if inf_at is not None:
        grads[0][inf_at, 0] = float("inf")
    opt.zero_grad()
    scaler.scale(torch.zeros(()))               # as scaling the loss would: the scale is made on first use
    for p, grad in zip(params, grads):
        p.grad = gt.distribute(grad, p.placement, p.sbp) if isinstance(p, GlobalTensor) else grad
    scaler.step(opt)
    scaler.update()


LAYOUTS = {"S(0)": ("1d", [S(0), S(0)]), "S(1)": ("1d", [S(1), B]), "2x2 (B, S(1))": ("2x2", [(B, S(1)), (S(0), B)])}


def _placement(kind: str):
    return gt.placement("cpu", [0, 1, 2, 3] if kind == "1d" else [[0, 1], [2, 3]])


@pytest.mark.parametrize("inf_at", [None, 9], ids=["finite", "inf-on-the-last-rank-only"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grad_scaler_sgd_step_equals_one_device(world4, layout, inf_at):
    """Row 9 of a [10, 6] parameter lies on the last rank's piece only (``S(0)``): every rank skips."""
    kind, sbps = LAYOUTS[layout]
    plain, glob = _params(_placement(kind), sbps)
    sides = []
    for params in (plain, glob):
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
        for step in range(3):
            _scaled_step(params, opt, scaler, step, inf_at if step == 1 else None)
        sides.append(scaler)
    assert sides[0].get_scale() == sides[1].get_scale() == (SCALE / 2 if inf_at is not None else SCALE)
    for p, want in zip(glob, plain):
        assert p.sbp == tuple(p.sbp)
        torch.testing.assert_close(p.full_tensor(), want.detach(), **EXACT)


@pytest.mark.parametrize("inf_at", [None, 0], ids=["finite", "inf-on-the-first-rank-only"])
def test_grad_scaler_with_a_fused_optimizer_equals_one_device(p1, inf_at):
    """A fused optimizer unscales inside its kernel (``grad_scale`` / ``found_inf``); GradScaler only
    checks for infs first."""
    plain, glob = _params(p1, [S(0), B])
    for params in (plain, glob):
        opt = torch.optim.AdamW(params, lr=0.05, fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
        for step in range(3):
            _scaled_step(params, opt, scaler, step, inf_at if step == 1 else None)
    for p, want in zip(glob, plain):
        scale = max(float(want.detach().abs().max()), 1.0)
        torch.testing.assert_close(p.full_tensor(), want.detach(), rtol=0, atol=32 * torch.finfo(want.dtype).eps * scale)


def test_found_inf_counts_for_the_whole_tensor(p1):
    """The unscale runs on each rank's pieces; an inf on one piece sets the one ``found_inf``."""
    grads = [gt.distribute(torch.ones(8, 3), p1, S(0)), gt.distribute(torch.ones(5), p1, B)]
    grads[0].local_tensors()[2][1, 1] = float("nan")
    found, inv = torch.zeros(1), torch.full((1,), 0.5)
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
    assert found.item() == 1.0
    torch.testing.assert_close(grads[1].full_tensor(), torch.full((5,), 0.5), **EXACT)


def test_autocast_with_a_tensor_parallel_model(p1):
    """bfloat16 autocast around the Megatron-split GPT: the same ops run in bfloat16 as on one device.
    Row-parallel layers sum bfloat16 partial products across ranks where one device sums them in one
    kernel; each rounding is <= 2**-8 relative and a dozen lie between the input and the loss, so
    the losses agree to ~5% and the gradients' largest entries to ~10%; a fault (a dropped rank's
    partial sum, a missing cast) is O(1)."""
    torch.manual_seed(0)
    model = GPT(CFG)
    reference = copy.deepcopy(model)
    gnn.distribute_module(model, p1, megatron())
    idx, targets = make_batch(CFG, BATCH, SEQ, torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.loss(gt.distribute(idx, p1, B), gt.distribute(targets, p1, B))
        want = reference.loss(idx, targets)
    assert loss.dtype == want.dtype
    torch.testing.assert_close(loss.full_tensor().float(), want.float(), rtol=5e-2, atol=0)
    loss.backward()
    want.backward()
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        assert p.grad.dtype == r.grad.dtype == torch.float32 and p.grad.sbp == p.sbp, name
        scale = float(r.grad.abs().max())
        torch.testing.assert_close(p.grad.full_tensor(), r.grad, rtol=0, atol=0.1 * scale + 1e-6, msg=name)


def _compiled_pair(p1, fused: bool, scaled: bool):
    """The same training step on two copies of a split model: one eager, one compiled."""
    steps, models = [], []
    for _ in range(2):
        torch.manual_seed(0)
        w = gt.distribute(torch.randn(6, 3, dtype=torch.float64), p1, S(0)).requires_grad_()
        opt = torch.optim.AdamW([w], lr=0.05, fused=fused, foreach=None if fused else True)
        scaler = torch.amp.GradScaler("cpu", init_scale=SCALE) if scaled else None

        def step(x, w=w, opt=opt, scaler=scaler):
            opt.zero_grad()
            loss = (x @ w).pow(2).sum()
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            return loss
        steps.append(step)
        models.append(w)
    return steps[0], gt.compile(steps[1]), models


@pytest.mark.parametrize("fused,scaled", [(True, False), (True, True), (False, False)],
                         ids=["fused", "fused+grad-scaler", "foreach"])
def test_compiled_step_equals_eager(p1, fused, scaled):
    """The compiled step runs the optimizer's own update on the same pieces as the eager step, fused or
    foreach (nn/optim_pieces.py: one task of the graph): exact."""
    eager, compiled, (w_eager, w_compiled) = _compiled_pair(p1, fused, scaled)
    tol = EXACT
    g = torch.Generator().manual_seed(5)
    for _ in range(4):
        x = gt.distribute(torch.randn(5, 6, dtype=torch.float64, generator=g), p1, B)
        torch.testing.assert_close(compiled(x).full_tensor(), eager(x).full_tensor(), **tol)
    torch.testing.assert_close(w_compiled.full_tensor(), w_eager.full_tensor(), **tol)
