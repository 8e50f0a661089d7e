"""gt.compile on training steps (forward, backward, optimizer): after every step the parameters,
the optimizer state and the returned loss equal those of the same model stepped eagerly.

Both sides are global models from the same init, in float64, fed the same batches; SGD with
momentum is bit-for-bit the eager update, AdamW runs in its capturable form (tensor bias
corrections: rounding differences only), hence a 1e-12 relative bound. Also: gt.nn modules with
Megatron plans on 1-D and 2x2, ZeroOptimizer, dropout in the model, an LR scheduler, and the
data-parallel gradients reduced in buckets (fewer collectives, the same bytes).
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import globaltensor as gt
import globaltensor.nn as gnn
from compile_helpers import assert_close_rel, assert_parameters_close, module_maker
from globaltensor.tensor import GlobalTensor
from nn_models import MEGATRON_1D, MEGATRON_2D, training_step

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum


def assert_states_match(opt_c, opt_e, params_c, params_e, step: int) -> None:
    for i, (pc, pe) in enumerate(zip(params_c, params_e)):
        sc, se = opt_c.state.get(pc, {}), opt_e.state.get(pe, {})
        assert set(sc) == set(se), f"step {step}, param {i}: state keys {set(sc)} != eager {set(se)}"
        for k, ve in se.items():
            vc = sc[k]
            if isinstance(ve, GlobalTensor) and ve.dim() > 0:
                assert_close_rel(vc, ve, f"step {step}, param {i}, state {k!r}")


def train_both(make, batches, steps: int, check_state: bool = True, **compile_kw):
    """``make()`` -> (module, optimizer, step function); one copy stepped eagerly, one compiled.
    Checks loss, every parameter and the optimizer state after each step. Returns the compiled fn."""
    m_e, opt_e, step_e = make()
    m_c, opt_c, step_c = make()
    g = gt.compile(step_c, **compile_kw)
    for s in range(steps):
        args = batches(s)
        loss_e, loss_c = step_e(*args), g(*args)
        assert_close_rel(loss_c, loss_e, f"step {s}: loss")
        assert_parameters_close(m_c, m_e, f"step {s}")
        if check_state:
            assert_states_match(opt_c, opt_e, list(m_c.parameters()), list(m_e.parameters()), s)
    assert g.captures == 1, f"one meta, one capture; got {g.captures}"
    return g


def _batches(placement, batch_sbp, rows: int = 8, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    data = [torch.randn(rows, 6, generator=gen) for _ in range(8)]
    return lambda s: (gt.distribute(data[s], placement, batch_sbp),)


SGD = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)                    # noqa: E731
ADAMW = lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1)          # noqa: E731
ZERO_ADAMW = lambda m: gnn.ZeroOptimizer(m.parameters(), torch.optim.AdamW, axis=0, lr=0.01)  # noqa: E731
ZERO_SGD = lambda m: gnn.ZeroOptimizer(m.parameters(), torch.optim.SGD, axis=0, lr=0.1, momentum=0.9)  # noqa: E731

LAYOUTS = {
    "data-parallel-1d": ("p1", {}, (S(0),)),
    "megatron-1d": ("p1", MEGATRON_1D, (B,)),
    "data-x-megatron-2x2": ("p2", MEGATRON_2D, (S(0), B)),
}
OPTIMIZERS = {"sgd-momentum": SGD, "adamw": ADAMW}


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_module_training_matches_eager(request, layout, opt_name):
    placement_name, plan, batch_sbp = LAYOUTS[layout]
    placement = request.getfixturevalue(placement_name)
    train_both(module_maker(placement, plan, OPTIMIZERS[opt_name]), _batches(placement, batch_sbp), steps=4)


@pytest.mark.parametrize("opt", [ZERO_ADAMW, ZERO_SGD], ids=["adamw", "sgd-momentum"])
@pytest.mark.parametrize("layout", ["data-parallel-1d", "data-x-megatron-2x2"])
def test_zero_optimizer_training_matches_eager(request, layout, opt):
    placement_name, plan, batch_sbp = LAYOUTS[layout]
    placement = request.getfixturevalue(placement_name)
    train_both(module_maker(placement, plan, opt), _batches(placement, batch_sbp), steps=4)


def test_fused_adamw_trains_like_eager_and_keeps_float32_step_counters(p1):
    """A fused optimizer's kernel reads its step counters as float32 (torch's own layout for fused);
    the capture's capturable form must keep them so -- float64 counters read as float32 gave NaN
    parameters on CUDA from the first graph run on (found on an H200)."""
    make = module_maker(p1, {}, lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1, fused=True))
    (m_e, _, step_e), (m_c, opt_c, step_c) = make(), make()
    g, batches = gt.compile(step_c), _batches(p1, (S(0),))
    for s in range(4):
        assert_close_rel(g(*batches(s)), step_e(*batches(s)), f"step {s}: loss")
        assert_parameters_close(m_c, m_e, f"step {s}")
    steps = [st["step"] for st in opt_c.state.values()]
    assert steps and all(t.dtype == torch.float32 for t in steps), {t.dtype for t in steps}


def test_explicit_parameters_adamw(p1):
    """The README's example: plain weights made global by hand, a loss with a mean over the batch."""
    torch.manual_seed(0)
    w0, b0 = torch.randn(8, 4), torch.randn(4)

    def make():
        m = nn.Module()
        m.w = nn.Parameter(w0.to_global(placement=p1, sbp=B).clone())
        m.b = nn.Parameter(b0.to_global(placement=p1, sbp=B).clone())
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        return m, opt, training_step(lambda x, y: ((x @ m.w + m.b - y) ** 2).mean(), opt)
    gen = torch.Generator().manual_seed(3)
    data = [(torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)) for _ in range(5)]
    train_both(make, lambda s: tuple(gt.distribute(t, p1, S(0)) for t in data[s]), steps=5)


class DropNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(6, 12), nn.Linear(12, 3)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return self.down(self.drop(torch.relu(self.up(x))))


@pytest.mark.parametrize("placement_name,plan,batch_sbp", [
    ("p1", gnn.megatron_plan(column=["up"], row=["down"]), (B,)),
    ("p2", gnn.megatron_plan(column=["up"], row=["down"], axis=1, ndim=2), (S(0), B)),
], ids=["megatron-1d", "2x2"])
def test_dropout_training_matches_eager(request, placement_name, plan, batch_sbp):
    """Dropout masks inside a compiled training step are the eager steps' masks (same gt seed)."""
    placement = request.getfixturevalue(placement_name)
    make = module_maker(placement, plan, SGD, model=DropNet)
    m_e, opt_e, step_e = make()
    m_c, opt_c, step_c = make()
    g = gt.compile(step_c)
    batches = _batches(placement, batch_sbp)
    for s in range(4):
        x = batches(s)[0]
        gt.manual_seed(100 + s)
        loss_e = step_e(x)
        gt.manual_seed(100 + s)
        loss_c = g(x)
        assert_close_rel(loss_c, loss_e, f"step {s}: loss")
        assert_parameters_close(m_c, m_e, f"step {s}")
    gt.manual_seed(999)
    probe = step_e(batches(5)[0])
    gt.manual_seed(12345)                          # another seed: another mask, another loss
    other = g(batches(5)[0])
    assert not torch.allclose(probe.full_tensor(), other.full_tensor(), rtol=1e-9, atol=0), \
        "the mask follows the seed (it is not frozen at capture)"


def test_lr_scheduler_matches_eager(p1):
    """A scheduler changing lr between compiled steps: each step uses the lr eager's uses, read by the
    graph at each run -- one capture, no warning."""
    make = module_maker(p1, {}, ADAMW)
    m_e, opt_e, step_e = make()
    m_c, opt_c, step_c = make()
    sched_e = torch.optim.lr_scheduler.StepLR(opt_e, step_size=2, gamma=0.5)
    sched_c = torch.optim.lr_scheduler.StepLR(opt_c, step_size=2, gamma=0.5)
    g = gt.compile(step_c)
    batches = _batches(p1, S(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for s in range(6):
            loss_e, loss_c = step_e(*batches(s)), g(*batches(s))
            assert_close_rel(loss_c, loss_e, f"step {s}: loss")
            assert_parameters_close(m_c, m_e, f"step {s}")
            sched_e.step()
            sched_c.step()
    assert [gr["lr"] for gr in opt_c.param_groups] == [gr["lr"] for gr in opt_e.param_groups]
    assert g.captures == 1


# -- gradient buckets ----------------------------------------------------------------------------
def _dp_step_stats(placement, bucket_bytes: int, compiled: bool):
    """One data-parallel SGD step after two (warm-up, capture), under gt.comm_stats()."""
    m, opt, step = module_maker(placement, {}, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                                bucket_bytes=bucket_bytes)()
    batches = _batches(placement, S(0))
    fn = gt.compile(step, bucket_bytes=bucket_bytes) if compiled else step
    fn(*batches(0))
    fn(*batches(1))
    with gt.comm_stats() as st:
        fn(*batches(2))
    return m, st


def _ideal_all_reduce_bytes(m, p: int) -> float:
    total = sum(t.numel() * t.element_size() for t in m.parameters())
    return 2 * (p - 1) / p * total


def test_bucketed_gradients_fewer_collectives_same_bytes(p1):
    m_e, eager = _dp_step_stats(p1, 0, compiled=False)               # each gradient reduced when read
    m_b, bucketed = _dp_step_stats(p1, 25 * 2 ** 20, compiled=False)  # eager buckets (grad_buckets.py)
    m_c, comp = _dp_step_stats(p1, 25 * 2 ** 20, compiled=True)
    n_params = len(list(m_c.parameters()))
    assert set(eager.ops()) == {"all_reduce"} and eager.count == n_params, eager.ops()
    assert comp.ops() == bucketed.ops() == ["all_reduce"], "every gradient fits one 25 MB bucket"
    assert comp.bytes_sent == bucketed.bytes_sent
    ideal = _ideal_all_reduce_bytes(m_c, 4)
    # the same payload as the one-by-one all-reduces; only the rounding of each tensor's ring chunks differs
    assert ideal <= comp.bytes_sent <= eager.bytes_sent, (ideal, comp.bytes_sent, eager.bytes_sent)
    assert eager.bytes_sent - comp.bytes_sent <= n_params * 2 * 3 * 8, (comp.bytes_sent, eager.bytes_sent)
    assert_parameters_close(m_c, m_e, "bucketed step")
    assert_parameters_close(m_b, m_e, "eager bucketed step")


def test_a_bucket_is_reduced_in_its_own_buffer(p1):
    """The compiled bucket's all-reduce writes the sums into the flat buffer the graph filled (no
    copy of the bucket on the collective stream, as DDP reduces its buckets), and is ordered as
    the write it is; a gradient reduced on its own is copied first, since it may be read again."""
    for bucket_bytes, want in ((25 * 2 ** 20, "all_reduce_in_place"), (0, "all_reduce")):
        m, opt, step = module_maker(p1, {}, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                                    bucket_bytes=bucket_bytes)()
        g = gt.compile(step, bucket_bytes=bucket_bytes, streams="rank")
        batches = _batches(p1, S(0))
        g(*batches(0))
        g(*batches(1))
        reductions = [t.node for t in g.plan.tasks if t.stream.endswith(":collective") and "all_reduce" in t.node.target]
        assert reductions and {n.target for n in reductions} == {want}, (bucket_bytes, [n.target for n in reductions])
        assert all(bool(n.writes) == (want == "all_reduce_in_place") and set(n.writes) <= set(n.reads)
                   for n in reductions)


def test_small_buckets_give_several_all_reduces(p1):
    m, small = _dp_step_stats(p1, 512, compiled=True)
    n_params = len(list(m.parameters()))
    assert 1 < small.count < n_params, small.ops()
    assert set(small.ops()) == {"all_reduce"}


def test_bucket_bytes_zero_reduces_each_gradient(p1):
    m_e, eager = _dp_step_stats(p1, 0, compiled=False)
    m_c, comp = _dp_step_stats(p1, 0, compiled=True)
    n_params = len(list(m_c.parameters()))
    assert comp.ops() == ["all_reduce"] * n_params, comp.ops()
    assert comp.bytes_sent == eager.bytes_sent
    assert_parameters_close(m_c, m_e, "unbucketed step")


def test_bucketed_gradients_left_in_place_equal_eager(p1):
    """zero_grad at the start: the .grad the compiled call leaves (the bucket's reduced slice)
    equals eager's, with the parameter's sbp, and behaves as eager's under in-place edits."""
    make = module_maker(p1, {}, SGD, zero_grad_first=True)
    for bucket_bytes in (25 * 2 ** 20, 0):
        m_e, _, step_e = make()
        m_c, _, step_c = make()
        g = gt.compile(step_c, bucket_bytes=bucket_bytes)
        batches = _batches(p1, S(0))
        for s in range(3):
            step_e(*batches(s))
            g(*batches(s))
            for (name, pc), pe in zip(m_c.named_parameters(), m_e.parameters()):
                assert pc.grad is not None, f"bucket_bytes={bucket_bytes}, step {s}: {name}.grad missing"
                assert pc.grad.sbp == pc.sbp, (name, pc.grad.sbp)
                assert_close_rel(pc.grad, pe.grad, f"bucket_bytes={bucket_bytes}, step {s}: {name}.grad")
        with torch.no_grad():
            for pc, pe in zip(m_c.parameters(), m_e.parameters()):
                pc.grad.mul_(2.0)
                pe.grad.mul_(2.0)
        for (name, pc), pe in zip(m_c.named_parameters(), m_e.parameters()):
            assert_close_rel(pc.grad, pe.grad, f"bucket_bytes={bucket_bytes}: {name}.grad after mul_(2)")


def test_a_compiled_optimizer_step_records_one_task_per_group(p1):
    """Three parameters of three layouts on 4 ranks: the captured AdamW update is one task over every
    rank's pieces (nn/optim_pieces.py), and each foreach op of a captured clipping is one task
    (ops/executor/lists.py: one local call per group of elements), not one per parameter."""
    ws = [gt.distribute(torch.randn(8, 4), p1, S(0)).requires_grad_(), gt.distribute(torch.randn(4), p1, B).requires_grad_(),
          gt.distribute(torch.randn(4, 8), p1, S(1)).requires_grad_()]
    opt = torch.optim.AdamW(ws, lr=0.1, foreach=True)

    def step(x):
        loss = ((x @ ws[0]) * ws[1]).sum() + ws[2].sum()
        loss.backward()
        torch._foreach_mul_([w.grad for w in ws], 0.5)
        opt.step()
        opt.zero_grad()
        return loss.detach()
    g = gt.compile(step)
    for _ in range(3):
        g(gt.distribute(torch.randn(5, 8), p1, B))
    names = [t.name for t in g.plan.tasks]
    assert len([n for n in names if "AdamW update on pieces" in n]) == 1 and not any("lerp" in n for n in names), names
    assert len([n for n in names if "_foreach_mul_" in n]) == 1, names
