"""The ops that write arguments they do not return (ops/schema/written_args.py), on random layouts beside one device.

Each op's sample runs with every tensor argument of one or more dims laid out by each recipe of
opinfo_run (split, broadcast, partial, nd; 0-dim tensors -- step counts, ``found_inf``, a tensor
``lr`` -- stay plain, taken as broadcast), and everything is compared with the same call on one
device: the outputs and every tensor argument after the call, written or not. Tolerances are
opinfo_run's (float32 sums regrouped over the pieces; the fused kernels' vector body and scalar
tail round alike to a few ulps). Random ops (``rrelu_with_noise``) compare shapes and dtypes only.
"""
from __future__ import annotations

import random

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

pytest.importorskip("expecttest", reason="opinfo_run imports torch's OpInfo database, which imports expecttest, a "
                                         "dev extra (pip install -e '.[dev]'; make test installs it)")

import globaltensor as gt  # noqa: E402
import opinfo_run as run  # noqa: E402
from globaltensor.ops.schema import written_args  # noqa: E402

aten = torch.ops.aten


def _params(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in [(8, 5), (7,), (4, 6)][:n]]


def _adam(lr_tensor=False):
    ps, gs, ms, vs = (_params(seed=k) for k in range(4))
    vs = [v.abs() for v in vs]
    steps = [torch.tensor(3.0) for _ in ps]
    lr = torch.tensor(0.05) if lr_tensor else 0.05
    return (ps, gs, ms, vs, [], steps), dict(lr=lr, beta1=0.9, beta2=0.99, weight_decay=0.01, eps=1e-6,
                                             amsgrad=False, maximize=False, grad_scale=None, found_inf=None)


def _sgd(lr_tensor=False):
    ps, gs, bufs = (_params(seed=k) for k in range(3))
    return (ps, gs, bufs), dict(weight_decay=0.01, momentum=0.9, lr=torch.tensor(0.1) if lr_tensor else 0.1,
                                dampening=0.0, nesterov=True, maximize=False, is_first_step=False)


def _adagrad(lr_tensor=False):
    ps, gs, sums = (_params(seed=k) for k in range(3))
    sums = [s.abs() for s in sums]
    return (ps, gs, sums, [torch.tensor(2.0) for _ in ps]), dict(lr=torch.tensor(0.1) if lr_tensor else 0.1,
                                                                 lr_decay=0.01, weight_decay=0.0, eps=1e-10,
                                                                 maximize=False)


def _unscale():
    gs = _params()
    gs[0][7, 2] = float("inf")                       # one rank's piece under a split of dim 0
    return (gs, torch.zeros(1), torch.full((1,), 0.25)), {}


def _batch_norm(training):
    g = torch.Generator().manual_seed(5)
    x, w, b = torch.randn(6, 3, 4, generator=g), torch.randn(3, generator=g), torch.randn(3, generator=g)
    return (x, w, b, torch.randn(3, generator=g), torch.rand(3, generator=g) + 0.5, training, 0.1, 1e-5), {}


def _batch_norm_with_update():
    (x, w, b, rm, rv, _, m, eps), _ = _batch_norm(True)
    return (x, w, b, rm, rv, m, eps), {}


def _cum_helper():
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(6))
    return (x, torch.empty(6, 5), torch.empty(6, 5, dtype=torch.long), 1), {}


SAMPLES = {
    "aten._fused_adam_.default": _adam,
    "aten._fused_adam_.tensor_lr": lambda: _adam(lr_tensor=True),
    "aten._fused_adamw_.default": _adam,
    "aten._fused_adamw_.tensor_lr": lambda: _adam(lr_tensor=True),
    "aten._fused_sgd_.default": _sgd,
    "aten._fused_sgd_.tensor_lr": lambda: _sgd(lr_tensor=True),
    "aten._fused_adagrad_.default": _adagrad,
    "aten._fused_adagrad_.tensor_lr": lambda: _adagrad(lr_tensor=True),
    "aten._amp_foreach_non_finite_check_and_unscale_.default": _unscale,
    "aten._amp_update_scale_.default": lambda: ((torch.full((1,), 1024.0), torch.tensor([3], dtype=torch.int32),
                                                 torch.zeros(1), 2.0, 0.5, 4), {}),
    "aten._native_batch_norm_legit.default": lambda: _batch_norm(True),
    "aten._batch_norm_with_update.default": _batch_norm_with_update,
    "aten._cummax_helper.default": _cum_helper,
    "aten._cummin_helper.default": _cum_helper,
    "aten.split_copy.Tensor_out": lambda: ((torch.randn(9, 4), 3, 0), {"out": [torch.empty(3, 4) for _ in range(3)]}),
    "aten.unbind_copy.int_out": lambda: ((torch.randn(3, 4, 2), 0), {"out": [torch.empty(4, 2) for _ in range(3)]}),
    "aten.rrelu_with_noise.default": lambda: ((torch.randn(6, 4), torch.empty(6, 4), 0.1, 0.3, True), {}),
}
RANDOM = {"aten.rrelu_with_noise.default"}
CASES = [(name, recipe) for name in SAMPLES for recipe in run.RECIPES]


def _op(name):
    packet, overload = name.removeprefix("aten.").split(".")
    return getattr(getattr(aten, packet), overload)


def test_the_samples_cover_every_fused_optimizer_and_amp_op_listed():
    listed = {n for n, path in written_args.HANDLED.items() if path == "list"}
    assert listed <= set(SAMPLES), f"listed list ops without a sample here: {sorted(listed - set(SAMPLES))}"


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name,recipe", CASES, ids=[f"{n}-{r}" for n, r in CASES])
def test_written_arguments_equal_one_device(name, recipe):
    op = _op(name)
    args, kwargs = SAMPLES[name]()
    flat, spec = tree_flatten((args, kwargs))
    reference = [v.clone() if isinstance(v, torch.Tensor) else v for v in flat]
    ref_args, ref_kwargs = tree_unflatten(reference, spec)
    torch.manual_seed(0)
    want = op(*ref_args, **ref_kwargs)
    rng = random.Random(run.seed_of(name, recipe))
    with gt.simulate(4):
        placement = run._placement(recipe)
        laid = []
        for v in flat:
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                laid.append(run.lay_out(v.clone(), placement, run._choose_sbp(v, recipe, placement.ndim, rng), rng))
            else:
                laid.append(v.clone() if isinstance(v, torch.Tensor) else v)
        g_args, g_kwargs = tree_unflatten(laid, spec)
        torch.manual_seed(0)
        got = op(*g_args, **g_kwargs)
        structure_only = name in RANDOM
        problem = run._mismatch(got, want, "output", structure_only) or \
            run._mismatch([v for v in laid if isinstance(v, torch.Tensor)],
                          [v for v in reference if isinstance(v, torch.Tensor)], "argument after the call",
                          structure_only)
    assert not problem, f"{name} on {recipe}: {problem}"
