"""Helpers of the gt.compile training and pipeline tests, which step a compiled copy of a model beside
an eager copy from the same init, in float64, and compare them after every step.

- ``assert_close_rel``: a compiled value equals the eager one (layout, then values to ``REL`` of
  the eager value's scale); ``assert_parameters_close`` checks every parameter of a module so.
- ``module_maker``: a ``make()`` giving a fresh (module, optimizer, training step) on each call.

(Not ``training_helpers``: tests/training has a module of that name, and both directories are
imported as top-level modules in one pytest process.)
"""
from __future__ import annotations

import globaltensor.nn as gnn
from globaltensor.tensor import GlobalTensor
from nn_models import net, training_step

# Compiled and eager steps differ by rounding only: the order of the gradient buckets' sums; a
# torch.optim elementwise optimizer's update is the eager one (nn/optim_pieces.py), a user's own is
# recorded op by op, in torch's capturable form where it has one (tensor bias corrections).
REL = 1e-12


def assert_close_rel(a: GlobalTensor, b: GlobalTensor, what: str, rel: float = REL) -> None:
    """``a`` (compiled side) equals ``b`` (eager side) in layout, and in value to ``rel`` of b's scale."""
    assert isinstance(a, GlobalTensor) and isinstance(b, GlobalTensor), what
    assert a.placement == b.placement and a.sbp == b.sbp, f"{what}: {a.placement} {a.sbp} != {b.placement} {b.sbp}"
    fa, fb = a.detach().full_tensor(), b.detach().full_tensor()
    assert fa.shape == fb.shape, what
    scale = max(fb.abs().max().item(), 1e-30)
    err = (fa - fb).abs().max().item()
    assert err <= rel * scale, f"{what}: max |compiled - eager| = {err:.3e}, {err / scale:.3e} of its scale"


def assert_parameters_close(m_c, m_e, what: str) -> None:
    """Every parameter of ``m_c`` (compiled side) equals ``m_e``'s (eager side), by ``assert_close_rel``."""
    for (name, pc), pe in zip(m_c.named_parameters(), m_e.parameters()):
        assert_close_rel(pc, pe, f"{what}: parameter {name}")


def module_maker(placement, plan, optimizer, model=net, *, zero_grad_first: bool = False,
                 bucket_bytes: int = gnn.grad_buckets.DEFAULT_BUCKET_BYTES):
    """A ``make()`` returning (module, optimizer, step): ``model()`` laid out on ``placement`` by
    ``plan``, ``optimizer(module)``, and the training step on the loss ``module(x).square().mean()``.
    ``model`` seeds its own init, so every call gives a copy from the same init."""
    def make():
        m = gnn.distribute_module(model(), placement, plan, bucket_bytes=bucket_bytes)
        opt = optimizer(m)
        return m, opt, training_step(lambda x: m(x).square().mean(), opt, zero_grad_first=zero_grad_first)
    return make

