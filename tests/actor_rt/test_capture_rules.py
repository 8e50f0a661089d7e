"""What a capture accepts and when it happens again: host reads and data-dependent shapes raise
gt.CaptureError naming the place; a new argument meta captures again, the same meta does not; a
changed optimizer hyper-parameter captures again with a warning; outputs keep their structure;
the .grad a compiled call leaves equals eager's."""
from __future__ import annotations

import inspect
import os
import warnings

import pytest
import torch

import globaltensor as gt
from globaltensor.tensor import GlobalTensor
from nn_models import training_step

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
HERE = os.path.basename(__file__)


def _line_of(fn, text: str) -> int:
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


def _capture_error(fn, *args, warmup=0) -> gt.CaptureError:
    g = gt.compile(fn, warmup=warmup)
    for _ in range(warmup):
        g(*args)                                  # the warm-up calls run eagerly: no error
    with pytest.raises(gt.CaptureError) as info:
        g(*args)
    return info.value


# -- host reads ----------------------------------------------------------------------------------
def test_item_raises_naming_the_line(p1):
    def fn(x):
        s = x.sum().item()
        return x * s
    x = gt.randn(8, 3, placement=p1, sbp=S(0))
    fn(x)                                         # fine eagerly
    err = str(_capture_error(fn, x, warmup=1))
    assert "x.sum().item()" in err, err
    assert f"{HERE}:{_line_of(fn, 'x.sum().item()')}" in err, err
    assert "fn" in err


def test_tolist_raises_naming_the_line(p1):
    def fn(x):
        n = x.sum(dim=0).tolist()
        return x * n[0]
    x = gt.randn(8, 3, placement=p1, sbp=S(0))
    fn(x)
    err = str(_capture_error(fn, x))
    assert "x.sum(dim=0).tolist()" in err, err
    assert f"{HERE}:{_line_of(fn, '.tolist()')}" in err, err


def test_a_host_read_is_never_frozen_silently(p1):
    """Whatever the outcome of a function that reads a value on the host, a compiled call must
    not return a result computed from a previous call's value."""
    def fn(x):
        return x * float(x.sum().numpy())
    g = gt.compile(fn, warmup=0)
    for i in range(3):
        x = gt.randn(8, 3, placement=p1, sbp=S(0))
        try:
            out = g(x)
        except gt.CaptureError:
            return
        torch.testing.assert_close(out.full_tensor(), fn(x).full_tensor(), rtol=1e-12, atol=1e-12,
                                   msg=lambda m: f"call {i}: the host read was frozen into the graph: {m}")


# -- data-dependent shapes -----------------------------------------------------------------------
DATA_DEPENDENT = {
    "nonzero": (lambda x: torch.nonzero(x > 0), "nonzero"),
    "boolean-mask": (lambda x: x[x > 0], "index"),
    "unique": (lambda x: torch.unique(x.to_global(sbp=B)), "unique"),
    "masked_select": (lambda x: torch.masked_select(x, x > 0), "masked_select"),
}


@pytest.mark.parametrize("case", list(DATA_DEPENDENT))
def test_data_dependent_shapes_raise_naming_the_op(p1, case):
    fn, op = DATA_DEPENDENT[case]
    x = gt.randn(8, 3, placement=p1, sbp=S(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")           # the eager fallback's one-time warning
        fn(x)                                     # works eagerly
        err = str(_capture_error(fn, x))
    assert op in err, err
    assert HERE in err, err


def test_the_error_leaves_state_and_the_function_usable(p1):
    """A failed capture restores what its dry run wrote; other metas still compile."""
    w = gt.randn(3, 3, placement=p1, sbp=B)
    before = w.full_tensor().clone()

    def fn(x, bad):
        w.add_(1.0)
        y = x @ w
        if bad:
            return y * y.sum().item()
        return y
    x = gt.randn(8, 3, placement=p1, sbp=S(0))
    g = gt.compile(fn, warmup=0)
    with pytest.raises(gt.CaptureError):
        g(x, True)
    assert torch.equal(w.full_tensor(), before), "the dry run's write into state was undone"
    out = g(x, False)
    assert torch.equal(w.full_tensor(), before + 1.0), "the compiled call made the call's write once"
    torch.testing.assert_close(out.full_tensor(), (x @ (before + 1.0).to_global(placement=p1, sbp=B)).full_tensor(),
                               rtol=1e-12, atol=1e-12)


# -- metas ---------------------------------------------------------------------------------------
def test_new_metas_capture_again_same_meta_does_not(p1, p2):
    def fn(x, k=1):
        return (x * 2.0 + k).to_global(sbp=(B,) * x.placement.ndim)
    g = gt.compile(fn)                            # warmup=1: per meta one eager call, then a capture
    calls = [
        (gt.randn(8, 3, placement=p1, sbp=S(0)), 1),      # eager
        (gt.randn(8, 3, placement=p1, sbp=S(0)), 1),      # capture 1
        (gt.randn(8, 3, placement=p1, sbp=S(0)), 1),      # same meta, new values
        (gt.randn(9, 3, placement=p1, sbp=S(0)), 1),      # shape: eager
        (gt.randn(9, 3, placement=p1, sbp=S(0)), 1),      # capture 2
        (gt.randn(8, 3, placement=p1, sbp=S(1)), 1),      # sbp: eager
        (gt.randn(8, 3, placement=p1, sbp=S(1)), 1),      # capture 3
        (gt.randn(8, 3, placement=p1, sbp=S(0), dtype=torch.float32), 1),   # dtype: eager
        (gt.randn(8, 3, placement=p1, sbp=S(0), dtype=torch.float32), 1),   # capture 4
        (gt.randn(8, 3, placement=p2, sbp=(S(0), B)), 1),  # placement: eager
        (gt.randn(8, 3, placement=p2, sbp=(S(0), B)), 1),  # capture 5
        (gt.randn(8, 3, placement=p1, sbp=S(0)), 2),      # another plain value: eager
        (gt.randn(8, 3, placement=p1, sbp=S(0)), 2),      # capture 6
        (gt.randn(8, 3, placement=p1, sbp=S(0)), 1),      # the first meta again: its graph
        (gt.randn(9, 3, placement=p1, sbp=S(0)), 1),
        (gt.randn(8, 3, placement=p1, sbp=S(0), dtype=torch.float32), 1),
    ]
    expected = [0, 1, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 6, 6]
    for i, ((x, k), captures) in enumerate(zip(calls, expected)):
        out, ref = g(x, k), fn(x, k)
        assert g.captures == captures, f"call {i}: {g.captures} captures, expected {captures}"
        assert out.sbp == ref.sbp and out.dtype == ref.dtype
        torch.testing.assert_close(out.full_tensor(), ref.full_tensor(), rtol=0, atol=0)


def test_requires_grad_is_part_of_the_meta(p1):
    def fn(x):
        return (x * 3.0).detach()
    g = gt.compile(fn, warmup=0)
    g(gt.randn(4, 2, placement=p1, sbp=S(0)))
    g(gt.randn(4, 2, placement=p1, sbp=S(0)))
    assert g.captures == 1
    g(gt.randn(4, 2, placement=p1, sbp=S(0), requires_grad=True))
    assert g.captures == 2


def test_plain_tensor_meta(p1):
    def fn(x, t):
        return x * t
    g = gt.compile(fn, warmup=0)
    x = gt.randn(4, 3, placement=p1, sbp=S(0))
    for t in (torch.randn(3), torch.randn(3)):
        torch.testing.assert_close(g(x, t).full_tensor(), fn(x, t).full_tensor(), rtol=0, atol=0)
    assert g.captures == 1
    t = torch.randn(4, 3)
    torch.testing.assert_close(g(x, t).full_tensor(), fn(x, t).full_tensor(), rtol=0, atol=0)
    assert g.captures == 2


# -- optimizer hyper-parameters ------------------------------------------------------------------
def _one_weight_model(p1, optimizer):
    """A weight (the same init on every call) trained by ``optimizer([w])``: (w, optimizer, step)."""
    torch.manual_seed(0)
    w = torch.randn(3, 2).to_global(placement=p1, sbp=B).clone().requires_grad_()
    opt = optimizer([w])
    return w, opt, training_step(lambda x: (x @ w).square().mean(), opt)


def test_a_changed_lr_is_read_by_the_graph_and_a_changed_flag_captures_again(p1):
    """SGD's settings are read by the graph at each run (nn/optim_pieces.py): a new lr and momentum are
    used by the next call with no capture; a flag the graph holds (``nesterov``) captures again, with a
    warning."""
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)     # noqa: E731
    w_e, opt_e, step_e = _one_weight_model(p1, sgd)
    w_c, opt_c, step_c = _one_weight_model(p1, sgd)
    g = gt.compile(step_c)
    xs = [gt.randn(8, 3, placement=p1, sbp=S(0)) for _ in range(7)]
    for i in range(3):
        with warnings.catch_warnings():
            warnings.simplefilter("error")         # no warning while nothing changes
            g(xs[i])
        step_e(xs[i])
    assert g.captures == 1
    for opt in (opt_e, opt_c):
        opt.param_groups[0].update(lr=0.05, momentum=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g(xs[3])
    step_e(xs[3])
    assert g.captures == 1
    torch.testing.assert_close(w_c.full_tensor(), w_e.full_tensor(), rtol=1e-12, atol=0,
                               msg=lambda m: f"the step after the change used the new lr: {m}")
    for opt in (opt_e, opt_c):
        opt.param_groups[0].update(nesterov=True, dampening=0.0)
    with pytest.warns(UserWarning, match="hyper-parameters changed"):
        g(xs[4])
    step_e(xs[4])
    assert g.captures == 2
    torch.testing.assert_close(w_c.full_tensor(), w_e.full_tensor(), rtol=1e-12, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g(xs[5])
    step_e(xs[5])
    assert g.captures == 2, "the new graph is kept"
    torch.testing.assert_close(w_c.full_tensor(), w_e.full_tensor(), rtol=1e-12, atol=0)


def test_a_tensor_lr_is_read_every_call(p1):
    """AdamW with a tensor lr: editing the tensor changes the next compiled step, without a capture."""
    adamw = lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(0.1))   # noqa: E731 -- a tensor per optimizer
    w_e, opt_e, step_e = _one_weight_model(p1, adamw)
    w_c, opt_c, step_c = _one_weight_model(p1, adamw)
    g = gt.compile(step_c)
    for i in range(5):
        x = gt.randn(8, 3, placement=p1, sbp=S(0))
        step_e(x)
        g(x)
        for opt in (opt_e, opt_c):
            opt.param_groups[0]["lr"].fill_(0.1 / (i + 2))
        scale = w_e.full_tensor().abs().max()
        assert (w_c.full_tensor() - w_e.full_tensor()).abs().max() <= 1e-12 * scale, f"step {i}"
    assert g.captures == 1


# -- outputs -------------------------------------------------------------------------------------
def test_outputs_keep_their_structure(p1):
    def fn(x):
        y = x * 2.0
        return {"y": y, "pair": (y.to_global(sbp=B), 3, [x + 1.0, "tag"]), "plain": torch.ones(2) * 5}
    x = gt.randn(8, 3, placement=p1, sbp=S(0), requires_grad=True)
    g = gt.compile(fn, warmup=0)
    for _ in range(2):
        out, ref = g(x), fn(x)
        assert type(out) is dict and list(out) == ["y", "pair", "plain"]
        assert type(out["pair"]) is tuple and len(out["pair"]) == 3
        assert type(out["pair"][2]) is list and out["pair"][2][1] == "tag" and out["pair"][1] == 3
        for got, want in ((out["y"], ref["y"]), (out["pair"][0], ref["pair"][0]), (out["pair"][2][0], ref["pair"][2][0])):
            assert isinstance(got, GlobalTensor) and got.sbp == want.sbp and got.placement == want.placement
            assert not got.requires_grad and got.grad_fn is None, "outputs are detached"
            torch.testing.assert_close(got.full_tensor(), want.full_tensor().detach(), rtol=0, atol=0)
        assert not isinstance(out["plain"], GlobalTensor)
        torch.testing.assert_close(out["plain"], ref["plain"], rtol=0, atol=0)


def test_one_tensor_and_one_element_tuple(p1):
    x = gt.randn(8, 3, placement=p1, sbp=S(0))
    single = gt.compile(lambda x: x + 1.0, warmup=0)
    one = gt.compile(lambda x: (x + 1.0,), warmup=0)
    for _ in range(2):
        assert isinstance(single(x), GlobalTensor)
        out = one(x)
        assert type(out) is tuple and len(out) == 1 and isinstance(out[0], GlobalTensor)


# -- gradients left in place ---------------------------------------------------------------------
@pytest.mark.parametrize("placement_name,w_sbp,x_sbp", [
    ("p1", B, S(0)),        # data parallel: a partial gradient, all-reduced
    ("p1", S(1), B),        # a split weight: the gradient split alike
    ("p2", (B, S(1)), (S(0), B)),
])
def test_param_grad_after_a_call_equals_eager(request, placement_name, w_sbp, x_sbp):
    placement = request.getfixturevalue(placement_name)

    def make():
        torch.manual_seed(0)
        w = gt.distribute(torch.randn(5, 4), placement, w_sbp).requires_grad_()
        opt = torch.optim.SGD([w], lr=0.1)
        return w, training_step(lambda x: torch.tanh(x @ w).square().mean(), opt, zero_grad_first=True)
    w_e, step_e = make()
    w_c, step_c = make()
    g = gt.compile(step_c)
    for i in range(4):
        x = gt.randn(8, 5, placement=placement, sbp=x_sbp)
        step_e(x)
        g(x)
        assert w_c.grad is not None, f"call {i}: no .grad left"
        assert w_c.grad.sbp == w_e.grad.sbp == w_c.sbp, (w_c.grad.sbp, w_e.grad.sbp)
        torch.testing.assert_close(w_c.grad.full_tensor(), w_e.grad.full_tensor(), rtol=1e-12, atol=1e-15,
                                   msg=lambda m: f"call {i}: .grad {m}")
        torch.testing.assert_close(w_c.full_tensor(), w_e.full_tensor(), rtol=1e-12, atol=1e-15)
