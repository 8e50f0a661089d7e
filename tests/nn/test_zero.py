"""gt.nn.ZeroOptimizer: optimizer state and update sharded over the data axis, same training; a
torch.optim.Optimizer (LR schedulers, hooks, add_param_group, state_dict round trips)."""
from __future__ import annotations

import copy
import io

import pytest
import torch

import globaltensor as gt
import globaltensor.nn as gnn
from globaltensor.tensor import GlobalTensor
from nn_models import MEGATRON_2D, TOL, net, train_net_side_by_side

S, B = gt.sbp.split, gt.sbp.broadcast
LAYOUTS = {"data-1d": ("p1", {}, S(0)), "data-x-tensor-2x2": ("p2", MEGATRON_2D, (S(0), B))}


@pytest.fixture(params=list(LAYOUTS))
def layout(request):
    """(placement, plan, batch sbp): data parallel on 4 ranks, and 2x2 data x Megatron tensor parallel."""
    name, plan, batch_sbp = LAYOUTS[request.param]
    return request.getfixturevalue(name), plan, batch_sbp


def test_shard_sbp(p1, p2):
    def layout(shape, placement, sbp):
        return gt.zeros(*shape, placement=placement, sbp=sbp)
    assert gnn.shard_sbp(layout((10, 6), p1, B), 0) == (S(0),)
    assert gnn.shard_sbp(layout((3, 8), p1, B), 0) == (S(1),), "the largest dim"
    assert gnn.shard_sbp(layout((5,), p1, B), 0) == (S(0),)
    assert gnn.shard_sbp(layout((), p1, B), 0) == (B,), "0-dim tensors are not split"
    assert gnn.shard_sbp(layout((10, 6), p1, S(1)), 0) == (S(1),), "already split on the axis"
    assert gnn.shard_sbp(layout((10, 6), p2, (B, S(0))), 0) == (S(1), S(0)), "a dim the tensor axis leaves"
    assert gnn.shard_sbp(layout((10,), p2, (B, S(0))), 0) == (S(0), S(0)), "no free dim: split it further"
    assert gnn.shard_sbp(layout((10, 6), p2, (B, B)), 1) == (B, S(0))


def _two_groups(m) -> list:
    return [{"params": list(m.blocks.parameters())}, {"params": [m.head.weight], "lr": 0.05}]


def _pair(layout, cls, kw, groups=_two_groups, axis=0):
    """A single-device net with ``cls`` and a distributed one with ZeroOptimizer over ``cls`` on
    ``axis``, from the same init, in float64 (see nn_models.TOL), each optimizer over ``groups(net)``.
    Returns (reference, model, their optimizers)."""
    placement, plan, _ = layout
    ref, m = net().double(), net().double()
    gnn.distribute_module(m, placement, plan)
    return ref, m, cls(groups(ref), **kw), gnn.ZeroOptimizer(groups(m), cls, axis=axis, **kw)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, GlobalTensor) else t


def _train_and_compare(layout, ref, m, opt_ref, opt, steps=2):
    placement, _, batch_sbp = layout
    train_net_side_by_side(ref, m, opt_ref, opt, placement, batch_sbp, steps)
    for (name, prm), want in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(prm.full_tensor(), want, **TOL, msg=name)


def _train(placement, plan, batch_sbp, cls, kw, steps=3, zero_axis=0):
    """Train a distributed and a single-device net side by side; the distributed one with
    ZeroOptimizer over ``zero_axis``. Returns (model, reference, optimizer)."""
    layout = (placement, plan, batch_sbp)
    ref, m, opt_ref, opt = _pair(layout, cls, kw, groups=lambda n: n.parameters(), axis=zero_axis)
    _train_and_compare(layout, ref, m, opt_ref, opt, steps)
    return m, ref, opt


def _state_is_sharded(m, opt, axis):
    """Every tensor state of every parameter is split over ``axis`` like its shard: per data-axis
    group, the pieces together hold the parameter once (1/n of it per rank)."""
    placement = next(m.parameters()).placement
    n = placement.hierarchy[axis]
    checked = 0
    for name, prm in m.named_parameters():
        shard = opt.shard_of(prm)
        assert shard is not None and shard.sbp == gnn.shard_sbp(prm, axis), name
        assert shard.sbp[axis].is_split, name
        assert prm.sbp[axis] == B, f"{name}: the parameter stays replicated on the data axis"
        for key, value in opt.state[shard].items():
            if not isinstance(value, GlobalTensor) or value.dim() == 0:
                continue
            assert value.sbp == shard.sbp, (name, key)
            held = sum(t.numel() for t in value.local_tensors().values())
            assert held * n == sum(t.numel() for t in prm.local_tensors().values()), (name, key)
            checked += 1
    assert checked >= len(list(m.parameters()))


@pytest.mark.parametrize("cls,kw", [
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    (torch.optim.AdamW, dict(lr=0.01, eps=1e-6, weight_decay=0.1)),
    (torch.optim.Adam, dict(lr=0.01, eps=1e-6, foreach=True)),
    (torch.optim.Adagrad, dict(lr=0.1)),
], ids=["sgd-momentum", "adamw", "adam-foreach", "adagrad-state-from-construction"])
def test_zero_data_parallel_matches_single_device(p1, cls, kw):
    m, _, opt = _train(p1, {}, S(0), cls, kw)
    _state_is_sharded(m, opt, 0)


def test_zero_on_the_data_axis_of_a_hybrid_placement(p2):
    m, _, opt = _train(p2, MEGATRON_2D, (S(0), B), torch.optim.AdamW, dict(lr=0.01, eps=1e-6))
    _state_is_sharded(m, opt, 0)
    up = opt.shard_of(m.blocks[0].up.weight)                     # [10, 6], tensor axis S(0)
    assert up.sbp == (S(1), S(0))
    assert [tuple(t.shape) for t in opt.state[up]["exp_avg"].local_tensors().values()] == [(5, 3)] * 4


def test_step_reduce_scatters_and_all_gathers_instead_of_all_reducing(p1):
    """The ZeRO step moves no more bytes than data parallelism's gradient all-reduce, without any all-reduce
    (the gradients, bucketed during the backward, reduce-scattered there)."""
    def one_step(zero):
        m = net()
        gnn.distribute_module(m, p1, {})
        opt = (gnn.ZeroOptimizer(m.parameters(), torch.optim.SGD, lr=0.1) if zero else
               torch.optim.SGD(m.parameters(), lr=0.1))
        loss = m(gt.distribute(torch.randn(8, 6), p1, S(0))).square().mean()
        with gt.comm_stats() as st:
            loss.backward()
            opt.step()
        return st
    dp, zero = one_step(False), one_step(True)
    assert set(dp.ops()) == {"all_reduce"}
    assert "all_reduce" not in zero.ops() and "all_gather" in zero.ops()
    assert zero.bytes_sent <= dp.bytes_sent * 1.1, (zero.bytes_sent, dp.bytes_sent)


def test_zero_grad_state_dict_closure_and_errors(p1):
    m = net()
    gnn.distribute_module(m, p1, {})
    opt = gnn.ZeroOptimizer([{"params": list(m.blocks.parameters())}, {"params": [m.head.weight], "lr": 0.5}],
                            torch.optim.SGD, lr=0.1, momentum=0.9)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.5]
    x = gt.distribute(torch.randn(8, 6), p1, S(0))

    def closure():
        opt.zero_grad()
        loss = m(x).square().mean()
        loss.backward()
        return loss
    loss = opt.step(closure)
    assert isinstance(loss, GlobalTensor) and m.head.weight.grad is not None
    assert m.head.weight.grad.sbp == opt.shard_of(m.head.weight).sbp      # read as ZeRO holds it: never gathered
    opt.zero_grad(set_to_none=False)
    assert m.head.weight.grad.full_tensor().abs().sum() == 0
    opt.zero_grad()
    assert all(p.grad is None for p in m.parameters())

    saved = copy.deepcopy(opt.state_dict())
    saved_momentum = {k: v["momentum_buffer"].full_tensor().clone() for k, v in saved["state"].items()}
    opt.step(closure)
    moved = opt.state_dict()["state"][0]["momentum_buffer"].full_tensor()
    assert not torch.allclose(moved, saved_momentum[0]), "the step changed the state"
    opt.load_state_dict(saved)
    for k, v in opt.state_dict()["state"].items():
        torch.testing.assert_close(v["momentum_buffer"].full_tensor(), saved_momentum[k])

    with pytest.raises(TypeError, match="global parameters"):
        gnn.ZeroOptimizer(net().parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="axis"):
        gnn.ZeroOptimizer(m.parameters(), torch.optim.SGD, axis=1, lr=0.1)
    with pytest.raises(ValueError, match="partial_sum"):
        gnn.ZeroOptimizer([gt.zeros(4, placement=p1, sbp=gt.sbp.partial_sum, requires_grad=True)],
                          torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="optimizer_class"):
        gnn.ZeroOptimizer(m.parameters(), "sgd", lr=0.1)
    with pytest.raises(ValueError, match="empty"):
        gnn.ZeroOptimizer([], torch.optim.SGD, lr=0.1)


# -- a torch.optim.Optimizer: groups, schedulers, hooks, state_dict ------------------------------

def test_is_a_torch_optimizer_over_the_parameters(p1):
    m = net()
    gnn.distribute_module(m, p1, {})
    opt = gnn.ZeroOptimizer(_two_groups(m), torch.optim.SGD, lr=0.1, momentum=0.9)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups[1]["params"][0] is m.head.weight, "the groups hold the parameters, not the shards"
    assert opt.defaults == torch.optim.SGD([torch.zeros(1)], lr=0.1, momentum=0.9).defaults
    hyper = [(g["lr"], g["momentum"], g["nesterov"]) for g in opt.param_groups]
    assert hyper == [(0.1, 0.9, False), (0.05, 0.9, False)], "the class's defaults are filled in"
    assert "ZeroOptimizer(SGD, axis=0)" in repr(opt) and "lr: 0.05" in repr(opt)
    m(gt.distribute(torch.randn(8, 6), p1, S(0))).square().mean().backward()
    opt.step()
    assert set(opt.state) == set(m.parameters()), "state is keyed by parameter"
    shard = opt.shard_of(m.head.weight)
    assert opt.state[shard] is opt.state[m.head.weight], "a shard reads its parameter's state"
    assert opt.state[m.head.weight]["momentum_buffer"].sbp == shard.sbp


SCHEDULES = {
    "step-lr": (torch.optim.SGD, dict(lr=0.1, momentum=0.9),
                lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.3)),
    "lambda-lr": (torch.optim.SGD, dict(lr=0.1, momentum=0.9),
                  lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda k: 1 / (1 + 2 * k))),
    "one-cycle": (torch.optim.AdamW, dict(lr=0.01, eps=1e-6),       # cycles AdamW's betas too
                  lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=4)),
    "cosine": (torch.optim.AdamW, dict(lr=0.02, eps=1e-6),
               lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=3)),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_lr_schedulers_change_the_rate_each_step_uses(layout, schedule):
    """A scheduler stepped after each optimizer step (from a post-hook) edits ``param_groups``; the
    pre-hook records the rates each step then uses. Parameters match a single-device run."""
    cls, kw, make = SCHEDULES[schedule]
    ref, m, opt_ref, opt = _pair(layout, cls, kw)
    used = {opt_ref: [], opt: []}
    for o in (opt_ref, opt):
        sched = make(o)
        o.register_step_pre_hook(lambda o, args, kwargs: used[o].append([g["lr"] for g in o.param_groups]))
        o.register_step_post_hook(lambda o, args, kwargs, sched=sched: sched.step())
    _train_and_compare(layout, ref, m, opt_ref, opt, steps=4)
    assert used[opt] == used[opt_ref] and len(used[opt]) == 4
    assert len({lrs[0] for lrs in used[opt]}) == 4, f"the rate did not change every step: {used[opt]}"
    assert opt.param_groups[0]["lr"] == opt_ref.param_groups[0]["lr"]


@pytest.mark.parametrize("cls,kw", [
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    (torch.optim.AdamW, dict(lr=0.01, eps=1e-6, weight_decay=0.1)),
], ids=["sgd-momentum", "adamw"])
def test_state_dict_round_trip_resumes_training(layout, cls, kw):
    """Save model, optimizer and scheduler after 2 steps (through torch.save), load them into a fresh
    model, ZeroOptimizer and scheduler, train 2 more: the same as 4 uninterrupted single-device steps."""
    def sched(o):
        return torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
    ref, m, opt_ref, opt = _pair(layout, cls, kw)
    sched_ref, sched_zero = sched(opt_ref), sched(opt)
    for o, s in ((opt_ref, sched_ref), (opt, sched_zero)):
        o.register_step_post_hook(lambda o, args, kwargs, s=s: s.step())
    _train_and_compare(layout, ref, m, opt_ref, opt)

    buf = io.BytesIO()
    torch.save({"model": m.state_dict(), "opt": opt.state_dict(), "sched": sched_zero.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    _, m2, _, opt2 = _pair(layout, cls, kw)
    m2.load_state_dict(saved["model"])
    sched2 = sched(opt2)
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    opt2.register_step_post_hook(lambda o, args, kwargs: sched2.step())
    assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups] == [0.25 * kw["lr"], 0.0125]
    _state_is_sharded(m2, opt2, 0)
    for p, p2 in zip(m.parameters(), m2.parameters()):
        for key, value in opt.state[p].items():
            torch.testing.assert_close(_full(opt2.state[p2][key]), _full(value))
    _train_and_compare(layout, ref, m2, opt_ref, opt2)


def test_add_param_group_shards_the_new_parameters(p1):
    layout = (p1, {}, S(0))
    ref, m, opt_ref, opt = _pair(layout, torch.optim.SGD, dict(lr=0.1, momentum=0.9),
                                 groups=lambda n: list(n.blocks.parameters()))
    _train_and_compare(layout, ref, m, opt_ref, opt)
    assert opt.shard_of(m.head.weight) is None
    opt_ref.add_param_group({"params": ref.head.weight, "lr": 0.05})
    opt.add_param_group({"params": m.head.weight, "lr": 0.05})
    assert opt.param_groups[1]["momentum"] == 0.9 and opt.param_groups[1]["params"] == [m.head.weight]
    assert opt.shard_of(m.head.weight).sbp == gnn.shard_sbp(m.head.weight, 0) == (S(1),)
    _train_and_compare(layout, ref, m, opt_ref, opt)
    _state_is_sharded(m, opt, 0)

    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [m.head.weight]})
    with pytest.raises(TypeError, match="global parameters"):
        opt.add_param_group({"params": [torch.zeros(3, requires_grad=True)]})
    with pytest.raises(TypeError, match="param_group must be a dict"):
        opt.add_param_group([m.head.weight])
    assert len(opt.param_groups) == 2, "a group that failed is not added"


def test_a_step_starts_from_the_parameters_as_they_are(p1):
    """A parameter written between steps (here: filled) is updated from its new value, not from the
    value its shard held since the last step."""
    m = net()
    gnn.distribute_module(m, p1, {})
    opt = gnn.ZeroOptimizer(m.parameters(), torch.optim.SGD, lr=0.1)
    x = gt.distribute(torch.randn(8, 6), p1, S(0))
    for _ in range(2):
        m(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        m.head.weight.fill_(1.0)
    m(x).square().mean().backward()
    grad = m.head.weight.grad.full_tensor().clone()
    opt.step()
    torch.testing.assert_close(m.head.weight.full_tensor(), 1.0 - 0.1 * grad)


def test_step_hooks_see_the_parameters_before_and_after_the_update(p1):
    m = net()
    gnn.distribute_module(m, p1, {})
    opt = gnn.ZeroOptimizer(m.parameters(), torch.optim.SGD, lr=0.1)
    seen = []
    pre = opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(("pre", m.head.weight.full_tensor().clone())))
    opt.register_step_post_hook(lambda o, args, kwargs: seen.append(("post", m.head.weight.full_tensor().clone())))
    before = m.head.weight.full_tensor().clone()
    m(gt.distribute(torch.randn(8, 6), p1, S(0))).square().mean().backward()
    opt.step()
    assert [k for k, _ in seen] == ["pre", "post"]
    torch.testing.assert_close(seen[0][1], before)
    torch.testing.assert_close(seen[1][1], m.head.weight.full_tensor())
    assert not torch.equal(seen[1][1], before)
    pre.remove()
    opt.step()
    assert [k for k, _ in seen] == ["pre", "post", "post"]


def test_a_deep_copy_trains_on_like_the_original(p1):
    layout = (p1, {}, S(0))
    ref, m, opt_ref, opt = _pair(layout, torch.optim.AdamW, dict(lr=0.01, eps=1e-6))
    _train_and_compare(layout, ref, m, opt_ref, opt)
    ref2, m2, opt_ref2, opt2 = copy.deepcopy((ref, m, opt_ref, opt))
    assert opt2.param_groups[0]["params"][0] is next(m2.parameters())
    assert opt2.shard_of(m2.head.weight) is not opt.shard_of(m.head.weight)
    _train_and_compare(layout, ref2, m2, opt_ref2, opt2)
    _train_and_compare(layout, ref, m, opt_ref, opt)
    for p, p2 in zip(m.parameters(), m2.parameters()):
        torch.testing.assert_close(p2.full_tensor(), p.full_tensor())
