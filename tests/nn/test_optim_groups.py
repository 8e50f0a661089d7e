"""An optimizer's lists reused between steps (nn/optim_groups.py): after each change torch's loop would
see, the lists are those torch's loop makes (the same objects, in the same order, the same returned
flags) -- or, where they are kept as pieces (nn/kept_pieces.py), those objects' pieces -- and while
nothing the loop reads changed they are reused, not remade.

Each check calls the wrapped ``_init_group`` first and torch's own second, on the same optimizer: a
reused list that missed a change (a partial gradient the ``.grad`` property would reduce, a gradient
dropped, a state made anew) differs from torch's there.
"""
from __future__ import annotations

import gc
import inspect
import weakref

import pytest
import torch

import globaltensor as gt
from globaltensor.nn import optim_groups
from optimizer_settings import FUSED, OPTIMIZERS

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
MODES = {"single": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}
CASES = [(name, mode) for name in OPTIMIZERS for mode in MODES if mode != "fused" or name in FUSED]
SHAPES = [(10, 6), (9,), (6, 10)]


def _layouts():
    p2 = gt.placement("cpu", [[0, 1], [2, 3]])
    return [(p2, (S(0), B)), (p2, (B, S(0))), (gt.placement("cpu", [2, 3]), (S(0),))]


def _params():
    g = torch.Generator().manual_seed(0)
    return [gt.distribute(torch.randn(s, dtype=torch.float64, generator=g), pl, sbp).requires_grad_()
            for s, (pl, sbp) in zip(SHAPES, _layouts())]


def _set_grads(params, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = gt.distribute(torch.randn(p.shape, dtype=torch.float64, generator=g), p.placement, p.sbp)


@pytest.fixture
def made(monkeypatch):
    """How many times a group's lists were made by torch's loop, watched (not reused)."""
    count = {"n": 0}
    of = optim_groups._Made.of

    def counted(*args):
        count["n"] += 1
        return of(*args)
    monkeypatch.setattr(optim_groups._Made, "of", staticmethod(counted))
    return count


def _empty_lists(opt) -> tuple:
    """As many empty lists as the optimizer's ``_init_group`` fills."""
    arity = len(inspect.signature(type(opt)._init_group.torch_init_group).parameters) - 2
    return tuple([] for _ in range(arity))


def _init_group_of(opt, group) -> tuple:
    """The wrapped loop's lists for ``group`` and what it returned."""
    lists = _empty_lists(opt)
    return lists, opt._init_group(group, *lists)


def _order(held: list) -> list:
    """The (element, rank) positions of the update's call on pieces: ranks outermost where every
    parameter shares one placement, else each element's ranks in turn."""
    if len({p.placement for p in held}) == 1:
        return [(i, r) for r in held[0].local_tensors() for i in range(len(held))]
    return [(i, r) for i, p in enumerate(held) for r in p.local_tensors()]


def _same_as_pieces(ours: list, theirs: list, order: list, what: str) -> None:
    """``ours`` (kept pieces, nn/kept_pieces.py) is torch's list ``theirs`` over ``order``: each global
    tensor's pieces; a plain state itself at its element's first position, an equal copy at the others."""
    assert len(ours) == len(order), what
    seen = set()
    for j, (i, r) in enumerate(order):
        want = theirs[i]
        if isinstance(want, gt.GlobalTensor):
            assert ours[j] is want.local_tensors()[r], f"{what}, position {j}"
        elif i in seen:
            assert ours[j] is not want and torch.equal(ours[j], want), f"{what}, position {j}"
        else:
            assert ours[j] is want, f"{what}, position {j}"
        seen.add(i)


def _lists_as_torchs(opt) -> None:
    """Each group's lists from the wrapped loop equal torch's loop's, element by element (identity) --
    or, where they are kept as pieces, torch's lists' pieces."""
    for group in opt.param_groups:
        torch_loop = type(opt)._init_group.torch_init_group
        ours, got = _init_group_of(opt, group)
        theirs = _empty_lists(opt)
        want = torch_loop(opt, group, *theirs)
        assert got == want
        on_pieces = bool(ours[0]) and not isinstance(ours[0][0], gt.GlobalTensor)
        for i, (a, b) in enumerate(zip(ours, theirs)):
            if on_pieces and b:
                _same_as_pieces(a, b, _order(theirs[0]), f"list {i}")
            else:
                assert len(a) == len(b) and all(x is y for x, y in zip(a, b)), f"list {i}"


def _loop_makes_states(name: str, mode: str) -> bool:
    """Whether torch's own loop makes an emptied state anew, on a plain parameter. Adagrad's states are
    made at construction before torch 2.10, and its loop then fails on an empty one with KeyError."""
    p = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    p.grad = torch.ones(3, dtype=torch.float64)
    opt = getattr(torch.optim, name)([p], **OPTIMIZERS[name], **MODES[mode])
    opt.step()
    opt.state[p].clear()
    try:
        opt.step()
    except KeyError:
        return False
    return True


def _first_state_tensor(opt, p):
    return next(k for k, v in opt.state[p].items() if isinstance(v, gt.GlobalTensor))


@pytest.mark.parametrize("name,mode", CASES)
def test_the_lists_are_torchs_after_every_change(world4, made, name, mode):
    params = _params()
    _set_grads(params, 1)
    opt = getattr(torch.optim, name)(params, **OPTIMIZERS[name], **MODES[mode])
    lr = opt.param_groups[0]["lr"]
    opt.step()                                  # states made (SGD's momentum buffers: at its first step)
    _lists_as_torchs(opt)

    def changed(event, remade: bool) -> None:
        before = made["n"]
        event()
        _lists_as_torchs(opt)
        assert (made["n"] > before) == remade, event.__doc__

    def nothing():
        """nothing changed: reused"""
    changed(nothing, remade=False)

    def new_gradients():
        """new gradients in layouts equal to their parameters' (not the same objects): reused"""
        _set_grads(params, 2)
    changed(new_gradients, remade=False)

    def a_step():
        """a step with a learning rate scheduled (the loop reads lr's kind only): reused"""
        opt.step()
        opt.param_groups[0]["lr"] = lr * 0.5
    changed(a_step, remade=False)

    def a_state_replaced():
        """a state's tensor replaced by another in its layout: reused, the new tensor in the lists"""
        key = _first_state_tensor(opt, params[0])
        opt.state[params[0]][key] = opt.state[params[0]][key].clone()
    changed(a_state_replaced, remade=False)

    def a_partial_gradient():
        """a partial gradient: reduced by the .grad property, as torch's loop reads it; reused"""
        pl, sbp = _layouts()[0]
        params[0].grad = gt.distribute(torch.randn(SHAPES[0], dtype=torch.float64), pl, sbp).to_global(
            sbp=(S(0), P))
    changed(a_partial_gradient, remade=False)

    def a_gradient_dropped():
        """a parameter without a gradient: made again"""
        params[1].grad = None
    changed(a_gradient_dropped, remade=True)

    def a_gradient_given_back():
        """a gradient again where there was none: made again"""
        _set_grads(params, 4)
    changed(a_gradient_given_back, remade=True)

    def a_state_cleared():
        """a parameter's state emptied (the loop makes it anew): made again"""
        opt.state[params[0]].clear()
    if _loop_makes_states(name, mode):
        changed(a_state_cleared, remade=True)
    else:
        saved = dict(opt.state[params[0]])
        a_state_cleared()
        with pytest.raises(KeyError):                # ours, as torch's: the emptied state is not reused
            _init_group_of(opt, opt.param_groups[0])
        opt.state[params[0]].update(saved)

    def loaded():
        """load_state_dict: new groups and states: made again"""
        _set_grads(params, 3)
        opt.load_state_dict(opt.state_dict())
    changed(loaded, remade=True)


def test_a_state_with_other_keys_is_read_by_torchs_loop(world4):
    """A state with as many entries but another key: torch's loop reads the key it wants, and fails."""
    params = _params()
    _set_grads(params, 1)
    opt = torch.optim.AdamW(params, lr=0.1)
    opt.step()
    opt.step()
    state = opt.state[params[0]]
    state["renamed"] = state.pop("exp_avg")
    with pytest.raises(KeyError, match="exp_avg"):
        opt._init_group(opt.param_groups[0], [], [], [], [], [], [])


class _OwnAdam(torch.optim.Adam):
    """A subclass: its lists stay global tensors, taken from the states by position."""


@pytest.mark.parametrize("make", [lambda ps: _OwnAdam(ps, lr=0.1), lambda ps: torch.optim.Adam(ps, lr=0.1)],
                         ids=["global lists", "kept pieces"])
def test_a_state_with_its_keys_in_another_order_remakes_the_lists(world4, made, make):
    """A state rebuilt with the same tensors, its keys in another order: the lists, taken by position,
    are made anew -- global lists because the keys differ, kept pieces because the tensors' order does."""
    params = _params()
    _set_grads(params, 1)
    opt = make(params)
    opt.step()
    opt.step()
    state = opt.state[params[0]]
    reordered = list(state.items())[::-1]
    state.clear()
    state.update(reordered)
    before = made["n"]
    _lists_as_torchs(opt)
    assert made["n"] == before + 1


def test_a_setting_the_loop_reads_remakes_the_lists(world4, made):
    """SGD's loop reads ``momentum`` (no buffers without it), Adam's reads ``amsgrad`` and refuses a
    tensor ``lr`` with ``foreach``: each change makes the lists again, as torch's loop would."""
    params = _params()
    _set_grads(params, 1)
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    sgd.step()
    sgd.step()
    _lists_as_torchs(sgd)
    before = made["n"]
    sgd.param_groups[0]["momentum"] = 0.0
    _lists_as_torchs(sgd)
    assert made["n"] == before + 1
    adam = torch.optim.Adam(params, lr=0.1, foreach=True)
    adam.step()
    _lists_as_torchs(adam)
    adam.param_groups[0]["lr"] = torch.tensor(0.1)
    with pytest.raises(RuntimeError, match="lr as a Tensor"):
        adam._init_group(adam.param_groups[0], [], [], [], [], [], [])


def test_a_group_added_gets_lists_of_its_own(world4, made):
    params = _params()
    _set_grads(params, 1)
    opt = torch.optim.AdamW(params[:2], lr=0.1)
    opt.step()
    _lists_as_torchs(opt)
    opt.add_param_group({"params": params[2:], "lr": 0.01})
    opt.step()
    _lists_as_torchs(opt)
    before = made["n"]
    _lists_as_torchs(opt)
    assert made["n"] == before
    assert len(optim_groups._made[opt]) == 2


def test_the_reused_lists_hold_no_gradient(world4):
    """What is kept between steps -- the parameters, and the states' pieces where the lists are kept as
    pieces (nn/kept_pieces.py) -- never holds a gradient: one freed by zero_grad is freed."""
    params = _params()
    _set_grads(params, 1)
    opt = torch.optim.Adam(params, lr=0.1, foreach=True)
    for _ in range(3):
        opt.step()
    gone = [weakref.ref(p.grad) for p in params]
    opt.zero_grad(set_to_none=True)
    gc.collect()
    assert all(r() is None for r in gone)


def test_plain_parameters_take_torchs_loop_unwatched(made):
    plain = [torch.randn(4, 3, requires_grad=True)]
    plain[0].grad = torch.ones(4, 3)
    opt = torch.optim.Adam(plain, lr=0.1)
    opt.step()
    opt.step()
    assert made["n"] == 0
    assert opt not in optim_groups._made


def test_an_optimizer_with_a_state_mapping_of_its_own_takes_torchs_loop(world4, made):
    """A ZeroOptimizer's inner optimizer finds each shard's state under its parameter (a mapping with
    its own look-up, which ``state.get`` would miss): its loop runs at every step, unwatched."""
    params = _params()[:2]
    zero = gt.nn.ZeroOptimizer(params, torch.optim.SGD, axis=0, lr=0.1, momentum=0.9)
    for seed in range(3):
        _set_grads(params, seed)
        zero.step()
    assert made["n"] == 0 and zero._optimizer not in optim_groups._made
