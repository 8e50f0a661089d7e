"""The shape of an update's call on pieces, kept between steps (nn/pieces_shape.py): a later call with
the same kinds of arguments in the same layouts takes it, and its tensors are that call's own; any
argument the shape does not fit makes the call anew -- or, where the pieces path cannot take it, the
present path (``PiecesCall.of`` is None)."""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.optim.adam as adam_module

import globaltensor as gt
from globaltensor.nn import optim_pieces
from globaltensor.nn.optim_pieces import PiecesCall

S, B = gt.sbp.split, gt.sbp.broadcast
ADAM = adam_module.adam.on_globals
NAMES = list(inspect.signature(ADAM).parameters)


def _adam_arguments(opt) -> dict:
    """The arguments Adam's step passes its update, from torch's own loop (global lists: the reused
    lists of a later step are pieces already, nn/kept_pieces.py)."""
    group = opt.param_groups[0]
    lists = ([], [], [], [], [], [])
    type(opt)._init_group.torch_init_group(opt, group, *lists)
    bound = dict(zip(NAMES, lists))
    bound.update(amsgrad=False, has_complex=False, beta1=0.9, beta2=0.999, lr=group["lr"], weight_decay=0.0,
                 eps=1e-8, maximize=False, foreach=group["foreach"], capturable=False, differentiable=False,
                 fused=group["fused"], grad_scale=None, found_inf=None, decoupled_weight_decay=False)
    return bound


#: where the process holds 4 ranks of each parameter (a 2 x 2 placement), and one (as each process of a job does)
PLACEMENTS = {"4 held": ([[0, 1], [2, 3]], [(S(0), B), (B, S(0)), (S(1), S(0))]),
              "1 held": ([0], [(B,), (S(0),), (S(1),)])}


@pytest.fixture(params=PLACEMENTS)
def adam(world4, request):
    ranks, sbps = PLACEMENTS[request.param]
    placement = gt.placement("cpu", ranks)
    g = torch.Generator().manual_seed(0)
    params = [gt.distribute(torch.randn(s, generator=g), placement, sbp).requires_grad_()
              for s, sbp in zip([(8, 6), (7,), (6, 8)], sbps)]
    for p in params:
        p.grad = gt.distribute(torch.randn(p.shape, generator=g), p.placement, p.sbp)
    opt = torch.optim.Adam(params, lr=0.1, foreach=True)
    opt.step()
    return opt


def test_a_later_call_takes_the_shape_with_its_own_tensors(adam):
    first = PiecesCall.of(ADAM, NAMES, _adam_arguments(adam))
    params = adam.param_groups[0]["params"]
    want = [p.local_tensors()[r] for r in params[0].local_tensors() for p in params]     # ranks outermost
    assert len(first.inputs) > len(want) and all(a is b for a, b in zip(first.inputs, want))
    for p in params:
        p.grad = p.grad.clone()
    bound = _adam_arguments(adam)
    again = PiecesCall.of(ADAM, NAMES, bound)
    assert again.shape is first.shape
    fresh = PiecesCall.of(ADAM, NAMES, bound)
    optim_pieces._shapes.kept.clear()
    made = PiecesCall.of(ADAM, NAMES, bound)
    assert made.shape is not first.shape
    assert all(a is b for a, b in zip(fresh.inputs, made.inputs)) and len(fresh.inputs) == len(made.inputs)
    assert all(a is b for a, b in zip(fresh.written, made.written)) and len(fresh.written) == len(made.written)
    assert any(t is params[0].grad.local_tensors()[0] for t in again.inputs)


def _another_layout(t):
    """``t`` broadcast on every axis, or where it is, split on its first dimension there."""
    whole = (B,) * t.placement.ndim
    return t.to_global(sbp=whole if tuple(t.sbp) != whole else (S(0),) + whole[1:])


def _state_in_another_layout(bound):
    bound["exp_avgs"][0] = _another_layout(bound["exp_avgs"][0])


def _plain_state_tensor(bound):
    bound["exp_avgs"][0] = torch.zeros(bound["exp_avgs"][0].shape)


def _gradient_in_another_layout(bound):
    bound["grads"][0] = _another_layout(bound["grads"][0])


def _fewer_parameters(bound):
    for k in ("params", "grads", "exp_avgs", "exp_avg_sqs", "state_steps"):
        bound[k] = bound[k][:2]


def _fused(bound):
    bound["fused"], bound["foreach"] = True, False


def _amsgrad_states(bound):
    bound["amsgrad"] = True
    bound["max_exp_avg_sqs"] = [t.clone() for t in bound["exp_avg_sqs"]]


def _a_tensor_lr(bound):
    bound["lr"] = torch.tensor(0.1)


def _an_argument_left_out(bound):
    del bound["grad_scale"]


@pytest.mark.parametrize("change,call", [
    (_state_in_another_layout, None),        # a state not in its parameter's layout: the present path
    (_plain_state_tensor, None),             # a plain tensor beside global ones: the present path
    (_gradient_in_another_layout, "made"),   # a gradient is boxed to its parameter's layout
    (_fewer_parameters, "made"),
    (_fused, "made"),                        # a fused update writes its gradients (unscaled)
    (_amsgrad_states, "made"),
    (_a_tensor_lr, "made"),
    (_an_argument_left_out, "made"),          # None given or its default: the call passes what was given
])
def test_a_call_the_shape_does_not_fit_is_made_anew(adam, change, call):
    kept = PiecesCall.of(ADAM, NAMES, _adam_arguments(adam)).shape
    bound = _adam_arguments(adam)
    change(bound)
    assert not kept.fits(bound)
    got = PiecesCall.of(ADAM, NAMES, bound)
    if call is None:
        assert got is None
    else:
        assert got.shape is not kept
