"""An elementwise optimizer's lists kept as pieces between steps (nn/kept_pieces.py): once its lists are
reused its update takes plain lists (GradScaler's plain tensors beside them); where the step reads its
lists (SGD), is a subclass's, or the update would take a global tensor beside them, they stay global;
and whatever replaces what was kept -- a state's tensor, a loaded state dict, a parameter's pieces
(``swap_tensors``, as a module's ``to`` does), a piece a compiled call rebinds -- is stepped, not the
old pieces. A step count's copies for the other ranks an element is held on are made once, and anew
where the count was written outside the update.

Results are compared with plain torch on one device in float64: the update runs torch's own kernels on
pieces, where a piece boundary may move an element between a kernel's vector body and its scalar
tail (fused multiply-adds or not). As test_optim_pieces.py argues, a step combines each element's
quantities with at most ~8 roundings of <= u relative, so ``steps`` steps stay within 8 u per step of
the largest magnitude involved: ``_close`` allows that.
"""
from __future__ import annotations

import copy
import gc
import importlib
import operator
import weakref

import pytest
import torch

import globaltensor as gt
from globaltensor.nn import optim_groups
from globaltensor.tensor import rebind_piece
from optimizer_settings import FUSED, OPTIMIZERS

S, B = gt.sbp.split, gt.sbp.broadcast
MODES = {"single": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}
KEPT = [(name, mode) for name in OPTIMIZERS if name != "SGD" for mode in MODES if mode != "fused" or name in FUSED]
SHAPES = [(10, 6), (9,), (6, 10)]


def _layouts():
    p2, sub = gt.placement("cpu", [[0, 1], [2, 3]]), gt.placement("cpu", [2, 3])
    return [(p2, (S(0), B)), (p2, (B, S(0))), (sub, (S(1),))]


def _values(seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, dtype=torch.float64, generator=g) for s in SHAPES]


def _pair(values: list) -> tuple:
    """The same values as plain parameters and as global ones."""
    plain = [v.clone().requires_grad_() for v in values]
    ours = [gt.distribute(v.clone(), pl, sbp).requires_grad_() for v, (pl, sbp) in zip(values, _layouts())]
    return plain, ours


def _step(opt, params, step: int) -> None:
    """One step, with gradients drawn for the parameters' shapes and dtypes (the same on both sides)."""
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        grad = torch.randn(p.shape, dtype=p.dtype, generator=g)
        p.grad = gt.distribute(grad, p.placement, p.sbp) if isinstance(p, gt.GlobalTensor) else grad
    opt.step()


def _close(ours: list, plain: list, steps: int) -> None:
    """Each global tensor within 8 u per step of its plain one's scale (the module's docstring)."""
    for i, (p, w) in enumerate(zip(ours, plain)):
        want = w.detach()
        scale = max(float(want.abs().max()), 1.0)
        atol = 8 * steps * torch.finfo(want.dtype).eps * scale
        torch.testing.assert_close(p.full_tensor(), want, rtol=0, atol=atol, msg=f"tensor {i}")


def _recorded_steps(handed, plain_side: tuple, global_side: tuple, steps: int) -> list:
    """``steps`` steps of each side's ``(optimizer, parameters)``, plain torch's first, the global side's
    update recorded (:func:`handed`); the parameters compared; the calls."""
    (want, plain), (opt, ours) = plain_side, global_side
    for step in range(steps):
        _step(want, plain, step)
    calls = handed(opt)
    for step in range(steps):
        _step(opt, ours, step)
    _close(ours, plain, steps)
    return calls


@pytest.fixture
def handed(monkeypatch):
    """The kinds of tensor each call of an optimizer's functional update was handed, per call:
    ``"global"`` or ``"plain"`` (its parameters' list)."""
    calls: list = []

    def watch(opt):
        module = importlib.import_module(type(opt).step.__module__)
        name = module.__name__.rsplit(".", 1)[-1]
        update = getattr(module, name)

        def recorded(params, *args, **kwargs):
            calls.append("global" if isinstance(params[0], gt.GlobalTensor) else "plain")
            return update(params, *args, **kwargs)
        monkeypatch.setattr(module, name, recorded)
        return calls
    return watch


@pytest.mark.parametrize("name,mode", KEPT)
def test_an_elementwise_update_takes_plain_lists_once_its_lists_are_reused(world4, handed, name, mode):
    """The first step's loop makes the states (global lists); the next reuse of the lists keeps them as
    pieces. (That is the second step, unless the states' making -- the parameter's first op -- gave the
    parameter an equal layout object interned before, by an earlier test, which its gradient does not
    have yet: then the lists are made once more.)"""
    plain, ours = _pair(_values())
    want = getattr(torch.optim, name)(plain, **OPTIMIZERS[name], **MODES[mode])
    opt = getattr(torch.optim, name)(ours, **OPTIMIZERS[name], **MODES[mode])
    calls = _recorded_steps(handed, (want, plain), (opt, ours), 5)
    assert calls[0] == "global" and calls[2:] == ["plain"] * 3, calls


class _OwnAdam(torch.optim.Adam):
    """A subclass: its step is its own code, which may read the lists it makes."""


@pytest.mark.parametrize("make", [lambda ps: torch.optim.SGD(ps, **OPTIMIZERS["SGD"]),
                                  lambda ps: _OwnAdam(ps, lr=0.05)], ids=["SGD", "a subclass of Adam"])
def test_a_step_that_may_read_its_lists_keeps_them_global(world4, handed, make):
    """SGD's step writes each momentum buffer back into the state by its parameter; a subclass's step is
    its own. Their lists stay global tensors (the update on pieces takes them as before)."""
    plain, ours = _pair(_values())
    want, opt = make(plain), make(ours)
    assert _recorded_steps(handed, (want, plain), (opt, ours), 4) == ["global"] * 4
    assert all(isinstance(s, gt.GlobalTensor) for p in ours for s in opt.state[p].values() if s is not None
               and s.dim() > 0)


def test_a_grad_scalers_fused_step_takes_plain_lists(world4, handed):
    """A fused update takes GradScaler's plain ``grad_scale`` and ``found_inf`` beside the kept lists and
    unscales the gradients' pieces; a step with an inf on one rank's piece is skipped on every rank."""
    plain, ours = _pair(_values())
    calls = None
    for params in (plain, ours):
        opt = torch.optim.AdamW(params, lr=0.05, fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        if params is ours:
            calls = handed(opt)
        for step in range(6):
            scaler.scale(torch.zeros(()))           # as scaling the loss would: the scale is made on first use
            grads = [g * 1024.0 for g in _values(100 + step)]
            if step == 4:
                grads[0][9, 0] = float("inf")       # row 9 of S(0) over 2: the second rank row's piece only
            for p, g in zip(params, grads):
                p.grad = gt.distribute(g, p.placement, p.sbp) if isinstance(p, gt.GlobalTensor) else g
            scaler.step(opt)
            scaler.update()
    assert calls[0] == "global" and calls[2:] == ["plain"] * 4, calls
    _close(ours, plain, 6)


def test_a_global_setting_keeps_the_lists_global(world4, handed):
    """A global learning-rate tensor goes to the update beside its lists: they stay global (the update
    runs through the dispatcher, as on the pieces path)."""
    plain, ours = _pair(_values())
    lr = gt.distribute(torch.tensor(0.05, dtype=torch.float64), gt.placement("cpu", [0, 1, 2, 3]), B)
    want = torch.optim.AdamW(plain, lr=torch.tensor(0.05, dtype=torch.float64), fused=True)
    opt = torch.optim.AdamW(ours, lr=lr, fused=True)
    assert _recorded_steps(handed, (want, plain), (opt, ours), 4) == ["global"] * 4


def _kept_run(event):
    """AdamW for 3 steps on both sides, ``event(opt, params)`` on each, then 2 more steps;
    the global side's optimizer and parameters, and the plain side's optimizer and parameters."""
    plain, ours = _pair(_values())
    sides = [(torch.optim.AdamW(plain, lr=0.05, weight_decay=0.1), plain),
             (torch.optim.AdamW(ours, lr=0.05, weight_decay=0.1), ours)]
    for step in range(3):
        for opt, ps in sides:
            _step(opt, ps, step)
    for opt, ps in sides:
        event(opt, ps)
    for step in range(3, 5):
        for opt, ps in sides:
            _step(opt, ps, step)
    _close(ours, plain, 5)
    return sides[1] + sides[0]


def test_a_replaced_state_tensor_is_the_one_stepped(world4):
    """The update steps the state's new tensor; the old one, which the kept pieces were of, stays as it was."""
    old = {}

    def replace(opt, params):
        if isinstance(params[0], gt.GlobalTensor):
            state = opt.state[params[0]]
            old["tensor"], old["value"] = state["exp_avg"], state["exp_avg"].full_tensor()
            state["exp_avg"] = state["exp_avg"].clone()
    opt, ours, want, plain = _kept_run(replace)
    assert torch.equal(old["tensor"].full_tensor(), old["value"])
    _close([opt.state[ours[0]]["exp_avg"]], [want.state[plain[0]]["exp_avg"]], 5)


def test_a_piece_rebound_is_the_one_stepped(world4):
    """A compiled call binds its results' pieces to the wrappers that outlive it (``rebind_piece``); a
    piece so given is the one the next eager step updates."""
    old = {}

    def rebind(opt, params):
        if isinstance(params[0], gt.GlobalTensor):
            state = opt.state[params[0]]["exp_avg_sq"]
            old["pieces"] = state.local_tensors()
            old["values"] = {r: t.clone() for r, t in old["pieces"].items()}
            for r, piece in old["pieces"].items():
                rebind_piece(state, r, piece.clone())
    opt, ours, want, plain = _kept_run(rebind)
    assert all(torch.equal(old["pieces"][r], v) for r, v in old["values"].items())
    _close([opt.state[ours[0]]["exp_avg_sq"]], [want.state[plain[0]]["exp_avg_sq"]], 5)


def test_a_loaded_state_dict_is_stepped_and_the_old_states_pieces_are_let_go(world4):
    """``load_state_dict`` of copies: the kept lists are forgotten at once, nothing holds the old states'
    pieces, and the next steps update the loaded states."""
    old_pieces = []

    def load(opt, params):
        if isinstance(params[0], gt.GlobalTensor):
            old_pieces.extend(weakref.ref(s) for p in params for v in opt.state[p].values()
                              if isinstance(v, gt.GlobalTensor) for s in v.local_tensors().values())
            assert optim_groups._made[opt][id(opt.param_groups[0])].kept is not None
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        if isinstance(params[0], gt.GlobalTensor):
            gc.collect()
            assert not optim_groups._made[opt]
            assert all(r() is None for r in old_pieces)          # nothing holds the old states' pieces
    _kept_run(load)


def test_cleared_states_pieces_are_let_go_before_the_loop_makes_new_ones(world4, monkeypatch):
    """Where the states are made anew (here: cleared), the old ones' kept pieces are let go before
    torch's loop makes the new ones: the step's peak holds one set of states, as torch's."""
    seen = []
    watched = optim_groups._WatchedGroup.__init__

    def at_the_loop(self, group):
        seen.append([r() is None for r in old_pieces])
        watched(self, group)
    monkeypatch.setattr(optim_groups._WatchedGroup, "__init__", at_the_loop)
    old_pieces = []

    def clear(opt, params):
        if isinstance(params[0], gt.GlobalTensor):
            assert optim_groups._made[opt][id(opt.param_groups[0])].kept is not None
            old_pieces.extend(weakref.ref(s) for p in params for v in opt.state[p].values()
                              if isinstance(v, gt.GlobalTensor) for s in v.local_tensors().values())
            seen.clear()
        opt.state.clear()
    _kept_run(clear)
    assert seen and all(seen[0]), seen


def test_a_parameter_given_new_pieces_is_stepped_in_them(world4):
    """``torch.utils.swap_tensors`` (a module's ``to`` uses it for tensor subclasses) gives the same
    parameter object other pieces: the update writes into those."""
    def swap(opt, params):
        for p in params:
            torch.utils.swap_tensors(p, p.detach().clone().requires_grad_())
    opt, ours, _, _ = _kept_run(swap)
    kept = optim_groups._made[opt][id(opt.param_groups[0])].kept
    assert all(p._pieces is pieces for p, pieces in zip(ours, kept.pieces))


def test_compiled_and_eager_steps_in_turn_step_the_pieces_the_graph_rebinds(p1):
    """Compiled first, the step makes the states inside the graph, which binds its pieces to them after
    every call (``tensor.rebind_piece``: the kept pieces are checked anew); compiled and eager steps in
    turn equal plain torch's, with one capture."""
    values = _values()[:2]
    plain = [v.clone().requires_grad_() for v in values]
    ours = [gt.distribute(v.clone(), p1, sbp).requires_grad_() for v, sbp in zip(values, [S(0), B])]
    want = torch.optim.AdamW(plain, lr=0.05, weight_decay=0.1)
    opt = torch.optim.AdamW(ours, lr=0.05, weight_decay=0.1)

    def step(*grads):
        for p, g in zip(ours, grads):
            p.grad = gt.distribute(g, p.placement, p.sbp)
        opt.step()
    compiled = gt.compile(step)
    for k in range(8):
        grads = _values(100 + k)[:2]
        for p, g in zip(plain, grads):
            p.grad = g
        want.step()
        (compiled if k // 2 % 2 == 0 else step)(*grads)
    assert compiled.captures == 1
    _close(ours, plain, 8)


@pytest.mark.parametrize("mode", ["single", "foreach"])
def test_complex_parameters_step_on_kept_pieces(p1, handed, mode):
    """The update views complex pieces as real ones in its own lists (``_view_as_real``), each step's
    copies of the kept lists: the kept pieces stay complex and the steps equal plain torch's."""
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(8, 3, dtype=torch.complex128, generator=g), torch.randn(5, dtype=torch.float64, generator=g)]
    plain = [v.clone().requires_grad_() for v in values]
    ours = [gt.distribute(v.clone(), p1, S(0)).requires_grad_() for v in values]
    want, opt = (torch.optim.Adam(ps, lr=0.05, **MODES[mode]) for ps in (plain, ours))
    calls = _recorded_steps(handed, (want, plain), (opt, ours), 5)
    assert calls[0] == "global" and calls[2:] == ["plain"] * 3, calls


def test_the_step_counts_copies_are_made_once(world4, monkeypatch):
    """An element held on several ranks here takes, at each extra one, a copy of its step count that the
    update steps with it: the same copies at every step of the kept lists, not new ones."""
    plain, ours = _pair(_values())
    want, opt = (torch.optim.AdamW(ps, lr=0.05, fused=True) for ps in (plain, ours))
    for step in range(5):
        _step(want, plain, step)
    module = importlib.import_module("torch.optim.adam")
    update, handed_steps = module.adam, []

    def recorded(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *args, **kwargs):
        handed_steps.append(list(state_steps))
        return update(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *args, **kwargs)
    monkeypatch.setattr(module, "adam", recorded)
    for step in range(5):
        _step(opt, ours, step)
    _close(ours, plain, 5)
    own = [opt.state[p]["step"] for p in ours]
    before, last = handed_steps[-2:]        # kept lists (from the third step at the latest)
    assert len(last) == 4 + 4 + 2 and all(any(s is t for s in last) for t in own)    # ranks held of each
    assert len(before) == len(last) and all(map(operator.is_, before, last)), "copies made anew"


@pytest.mark.parametrize("write", [lambda t: t.add_(3), lambda t: t.fill_(1)], ids=["add_", "fill_"])
def test_a_step_count_written_outside_the_update_reaches_every_rank(world4, write):
    """A step count changed in place between steps (its tensor the same, its copies stale) is copied anew
    to every other rank the element is held on: every piece's bias correction is the new count's."""
    _kept_run(lambda opt, params: [write(opt.state[p]["step"]) for p in params])


def test_steps_under_inference_mode_copy_the_step_counts_at_each_step(world4):
    """Steps run under ``torch.inference_mode`` make inference tensors of the step counts, which have no
    version counter: their copies are made at every step, and the steps equal plain torch's."""
    plain, ours = _pair(_values())
    for params in (plain, ours):
        opt = torch.optim.AdamW(params, lr=0.05, fused=True)
        for step in range(5):
            with torch.inference_mode():
                _step(opt, params, step)
    _close(ours, plain, 5)
