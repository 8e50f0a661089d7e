"""Checks shared by the tests that train a distributed model beside its single-device reference
(tests/training's GPT, tests/models' HuggingFace models): float64 runs, compared to the tolerance
their helpers derive (``tol``: ``rtol`` / ``atol`` for ``torch.testing.assert_close``)."""
from __future__ import annotations

from typing import Iterable, Tuple

import torch

from globaltensor import GlobalTensor


def check_gradients(step: int, grads: Iterable[Tuple[str, object, tuple]], ref_params, tol: dict) -> None:
    """Each ``(name, gradient, sbp)``: a global tensor of that sbp, equal to the reference
    parameter's gradient."""
    for (name, g, sbp), q in zip(grads, ref_params):
        assert isinstance(g, GlobalTensor), f"step {step}: {name} has no global gradient ({type(g).__name__})"
        assert g.sbp == sbp, f"step {step}: {name}'s gradient has sbp {g.sbp}, expected {sbp}"
        torch.testing.assert_close(g.full_tensor(), q.grad, **tol, msg=lambda m: f"step {step}: gradient of {name}: {m}")


def check_parameters(names, params, ref_params, tol: dict, when: str) -> None:
    """Every parameter equals the reference's (``when``: the point of the run, for the message)."""
    for name, p, q in zip(names, params, ref_params):
        torch.testing.assert_close(p.full_tensor(), q.detach(), **tol, msg=lambda m: f"{name} {when}: {m}")
