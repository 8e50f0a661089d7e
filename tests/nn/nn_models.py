"""Small models for the gt.nn tests: linears that a Megatron plan can split, a layer norm, a buffer.

Also ``training_step``, the step that the gt.compile tests (tests/actor_rt, and the launched
tests/multiprocess/_compiled_program.py) run eagerly on one copy of a model and compile on another.
"""
from __future__ import annotations

import torch
from torch import nn

import globaltensor as gt
import globaltensor.nn as gnn


class Block(nn.Module):
    """A column-parallel linear, GELU, a row-parallel linear, a layer norm and a buffer."""

    def __init__(self, d=6, hidden=10):
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)
        self.norm = nn.LayerNorm(d)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        return self.norm(x + self.down(torch.nn.functional.gelu(self.up(x)))) * self.scale


class Net(nn.Module):
    def __init__(self, d=6, hidden=10, layers=2):
        super().__init__()
        self.blocks = nn.ModuleList([Block(d, hidden) for _ in range(layers)])
        self.head = nn.Linear(d, 3, bias=False)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def net(seed=0, **kw) -> Net:
    torch.manual_seed(seed)
    return Net(**kw)


MEGATRON_1D = gnn.megatron_plan(column=["*.up"], row=["*.down"])
MEGATRON_2D = gnn.megatron_plan(column=["*.up"], row=["*.down"], axis=1, ndim=2)


# Distributed and single-device nets are compared in float64 (``net().double()``); they differ by the
# order of sums only (split matmuls, all-reduces). A gradient entry sums n <= ~10 terms of size
# <= ~2, so it differs by d <= n * u * 2 = 2e-15 at worst (u = 1.1e-16). SGD moves parameters by
# lr * d; Adam, AdamW and Adagrad divide by a running gradient size plus eps, so by up to
# lr * d / max(|g|, eps): with eps = 1e-6 (Adam, AdamW; lr <= 0.05) or |g| >= ~2e-6 (Adagrad's
# eps is 1e-10; lr = 0.1), <= 1e-10 per step, 4e-10 over the 4 steps a test takes at most. TOL is
# 2.5x that worst case; the differences seen are ~1e-15. In float32 (u = 6e-8) the same path gives
# ~1e-5, the size of the rounding differences between CPUs (vector widths), so no float32
# tolerance both holds on every machine and catches a real fault.
TOL = dict(rtol=1e-9, atol=1e-9)


def train_net_side_by_side(ref, m, opt_ref, opt, placement, batch_sbp, steps: int) -> None:
    """``steps`` optimizer steps of the float64 net ``ref`` on plain inputs and of the float64 net ``m``
    on the same inputs as global tensors (``batch_sbp`` on ``placement``); every step's loss must agree."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(8, 6, generator=gen, dtype=torch.float64)
        loss_ref = ref(x).square().mean()
        loss = m(gt.distribute(x, placement, batch_sbp)).square().mean()
        torch.testing.assert_close(loss.full_tensor(), loss_ref, **TOL)
        loss_ref.backward()
        loss.backward()
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()


def training_step(loss_fn, opt, *, zero_grad_first: bool = False):
    """A training step: ``loss_fn(*batch)``, its backward, ``opt.step()``, the gradients zeroed; it
    returns the loss, detached. With ``zero_grad_first`` the gradients are zeroed before the forward
    instead, so that the ``.grad`` a step leaves can be compared after it."""
    def step(*batch):
        if zero_grad_first:
            opt.zero_grad()
        loss = loss_fn(*batch)
        loss.backward()
        opt.step()
        if not zero_grad_first:
            opt.zero_grad()
        return loss.detach()
    return step
