"""The elementwise optimizers step on the pieces (nn/optim_pieces.py): no ``__torch_dispatch__`` in the
update, the same result as the path through the dispatcher (bit for bit: the same kernels on the same
pieces) and one device's result within rounding. (Under ``gt.compile``: tests/actor_rt/test_compile_optimizers.py.)

The gradients are given (the same values on both sides) rather than computed, so the update is the
only computation compared. Against one device the pieces may differ in the last bits: torch's CPU
kernels compute a vector-width body and a scalar tail with different instruction sequences (fused
multiply-adds or not), and a piece boundary moves elements between the two; a step combines each
element's quantities with at most ~8 roundings of <= u relative, so 3 steps with their states stay
within 24 u of the largest magnitude involved: ``_whole_close`` allows 32 u of it (float64).
"""
from __future__ import annotations

import importlib
import inspect

import pytest
import torch

import globaltensor as gt
from globaltensor.nn import optim_groups, optim_pieces
from globaltensor.tensor import GlobalTensor
from optimizer_settings import FUSED, OPTIMIZERS, WHOLE_OPTIMIZERS

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
EXACT = dict(rtol=0, atol=0)

MODES = {"single": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}
CASES = [(name, mode) for name in OPTIMIZERS for mode in MODES if mode != "fused" or name in FUSED]
SHAPES = [(10, 6), (9,), (6, 10), (7, 3)]            # uneven over 2 and 4 ranks


def _layouts(world):
    """A 2x2 placement's layouts, and a parameter on a 2-rank placement of its own."""
    p2, sub = gt.placement("cpu", [[0, 1], [2, 3]]), gt.placement("cpu", [2, 3])
    return [(p2, (S(0), B)), (p2, (B, S(0))), (p2, (S(1), S(0))), (sub, (S(0),))]


def _grads(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, dtype=torch.float64, generator=g) for s in SHAPES]


def _params():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, dtype=torch.float64, generator=g) for s in SHAPES]


def _make(name: str, mode: str, params):
    return getattr(torch.optim, name)(params, **OPTIMIZERS[name], **MODES[mode])


def _run(opt, params, steps=3, scheduler=True):
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7) if scheduler else None
    for step in range(steps):
        for p, g in zip(params, _grads(step)):
            p.grad = gt.distribute(g, p.placement, p.sbp) if isinstance(p, GlobalTensor) else g
        opt.step()
        if sched is not None:
            sched.step()
    return opt


def _global_params(world):
    return [gt.distribute(v, placement, sbp).requires_grad_()
            for v, (placement, sbp) in zip(_params(), _layouts(world))]


def _whole_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within 32 u of the tensor's scale (see the module's docstring)."""
    scale = max(float(want.abs().max()) if want.numel() else 0.0, 1.0)
    torch.testing.assert_close(got, want, rtol=0, atol=32 * torch.finfo(want.dtype).eps * scale)


@pytest.fixture
def through_dispatch(monkeypatch):
    """The present path: every functional update its original, op by op through the dispatcher, on
    global lists (none kept as pieces, nn/kept_pieces.py)."""
    kept = set(optim_groups.ON_PIECES)

    def use():
        for name in optim_pieces.ELEMENTWISE:
            module = importlib.import_module(f"torch.optim.{name}")
            monkeypatch.setattr(module, name, getattr(module, name).on_globals)
        optim_groups.ON_PIECES.clear()
    yield use
    optim_groups.ON_PIECES.update(kept)


@pytest.mark.parametrize("name,mode", CASES)
def test_the_step_on_pieces_equals_the_dispatch_path_and_one_device(world4, through_dispatch, name, mode):
    plain = [v.clone().requires_grad_() for v in _params()]
    want = _run(_make(name, mode, plain), plain)
    ours = _global_params(world4)
    opt = _run(_make(name, mode, ours), ours)
    through_dispatch()
    theirs = _global_params(world4)
    opt_d = _run(_make(name, mode, theirs), theirs)
    for i, (p, d, w) in enumerate(zip(ours, theirs, plain)):
        for r, piece in p.local_tensors().items():
            torch.testing.assert_close(piece, d.to_local(rank=r), **EXACT, msg=f"parameter {i}, rank {r}")
        _whole_close(p.full_tensor(), w.detach())
        for key, value in opt.state[p].items():
            other, ref = opt_d.state[d][key], want.state[w][key]
            if isinstance(value, GlobalTensor):
                assert value.sbp == p.sbp, key
                for r, piece in value.local_tensors().items():
                    torch.testing.assert_close(piece, other.to_local(rank=r), **EXACT, msg=f"{key} of {i}, rank {r}")
                _whole_close(value.full_tensor(), ref)
            else:
                torch.testing.assert_close(value, other, **EXACT, msg=key)     # step counts: one per parameter
                torch.testing.assert_close(value, ref, **EXACT, msg=key)


@pytest.mark.parametrize("name,mode", CASES)
def test_the_step_on_pieces_dispatches_nothing(world4, name, mode):
    """After the first step (which makes the states; SGD's momentum buffers go through the dispatcher
    there, made lazily), a step is the plain update: no global op is dispatched."""
    params = _global_params(world4)
    opt = _run(_make(name, mode, params), params, steps=2, scheduler=False)
    for p, g in zip(params, _grads(5)):
        p.grad = gt.distribute(g, p.placement, p.sbp)
    before = gt.dispatch_cache_info()
    opt.step()
    after = gt.dispatch_cache_info()
    assert (after.hits, after.misses) == (before.hits, before.misses)


class _OwnSGD(torch.optim.Optimizer):
    """A user's own optimizer: its update is its code, which the library does not know to be elementwise."""

    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"])


def test_other_optimizers_keep_the_dispatch_path(world4):
    """LBFGS is not elementwise (its direction comes from a history of whole gradients), a
    ``differentiable`` update must stay in autograd, a user's own optimizer is its own code: they step
    through the dispatcher, and ``steps_on_pieces`` says so."""
    params = _global_params(world4)
    assert not optim_pieces.steps_on_pieces(torch.optim.LBFGS(params[:1]))
    assert not optim_pieces.steps_on_pieces(torch.optim.Adam(params, differentiable=True))
    assert optim_pieces.steps_on_pieces(torch.optim.Adam(params))
    assert optim_pieces.steps_on_pieces(gt.nn.ZeroOptimizer(params[:3], torch.optim.AdamW, axis=0))
    own = _OwnSGD(params, lr=0.1)
    assert not optim_pieces.steps_on_pieces(own)
    plain = [v.clone().requires_grad_() for v in _params()]
    _run(_OwnSGD(plain, lr=0.1), plain, scheduler=False)
    before = gt.dispatch_cache_info()
    _run(own, params, scheduler=False)
    assert gt.dispatch_cache_info().hits > before.hits
    for p, w in zip(params, plain):
        torch.testing.assert_close(p.full_tensor(), w.detach(), **EXACT)


def test_every_number_setting_reaches_the_update_or_only_makes_states():
    """A number setting of a group that the update never receives must be one that only makes states
    (STATE_INIT_ONLY): else a graph would hold it, unread, and a change would go unseen. Checked on
    this torch's optimizers (their settings differ between releases)."""
    for name in OPTIMIZERS:
        opt = getattr(torch.optim, name)([torch.nn.Parameter(torch.randn(2))])
        module = importlib.import_module(type(opt).__module__)
        update = getattr(module, module.__name__.rsplit(".", 1)[-1])
        taken = set(inspect.signature(update.on_globals).parameters)
        group = opt.param_groups[0]
        numbers = {k for k, v in group.items() if type(v) in (int, float) and k not in taken}
        assert numbers == set(optim_pieces.STATE_INIT_ONLY.get(name, ())), name


def _whole_params(name: str, placement, sbp):
    """Muon's 2-D parameters, Adafactor's of every rank (factored and not), as global tensors."""
    values = [v for v in _params() if v.dim() == 2 or name != "Muon"]
    return values, [gt.distribute(v, placement, sbp).requires_grad_() for v in values]


@pytest.mark.parametrize("layout", ["broadcast", "split", "zero"])
@pytest.mark.parametrize("name", list(WHOLE_OPTIMIZERS))
def test_a_whole_tensor_optimizer_steps_on_whole_pieces(p1, name, layout):
    """Muon and Adafactor read each parameter whole. Broadcast parameters (data parallel): each rank
    updates its whole copy, as the plain update on plain tensors. Split ones (tensor parallel) and a
    ZeroOptimizer's shards: gathered whole, updated so, each rank's part written back. Either way
    the same kernels on the same values as one device: exact; the states in their own shapes
    (Adafactor's row and column statistics); and with broadcast parameters no global op dispatched
    after the first step."""
    values, params = _whole_params(name, p1, S(0) if layout == "split" else B)
    plain = [v.clone().requires_grad_() for v in values]
    cls = getattr(torch.optim, name)
    opt = gt.nn.ZeroOptimizer(params, cls, axis=0, **WHOLE_OPTIMIZERS[name]) if layout == "zero" else \
        cls(params, **WHOLE_OPTIMIZERS[name])
    ref = cls(plain, **WHOLE_OPTIMIZERS[name])
    assert optim_pieces.steps_on_pieces(opt)
    for step in range(3):
        grads = [g for g in _grads(step) if g.dim() == 2 or name != "Muon"]
        for p, q, g in zip(params, plain, grads):
            p.grad, q.grad = gt.distribute(g, p1, p.sbp), g
        before = gt.dispatch_cache_info()
        opt.step()
        ref.step()
        if step and layout == "broadcast":
            after = gt.dispatch_cache_info()
            assert (after.hits, after.misses) == (before.hits, before.misses)
    for i, (p, q) in enumerate(zip(params, plain)):
        torch.testing.assert_close(p.full_tensor(), q.detach(), **EXACT, msg=f"parameter {i}")
