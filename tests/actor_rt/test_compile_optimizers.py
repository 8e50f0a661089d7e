"""An elementwise optimizer's update under ``gt.compile`` (nn/optim_pieces.py): one task of the graph,
reading the optimizer's settings at each run -- a learning-rate schedule makes no new capture -- and
equal to the eager steps, for every elementwise ``torch.optim`` optimizer and ZeroOptimizer's."""
from __future__ import annotations

import warnings

import pytest
import torch

import globaltensor as gt
from compile_helpers import assert_close_rel, assert_parameters_close
from optimizer_settings import OPTIMIZERS, WHOLE_OPTIMIZERS

S, B = gt.sbp.split, gt.sbp.broadcast


def _training(name: str, placement):
    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()
    gt.nn.distribute_module(lin, placement, gt.nn.megatron_plan(column=["0"], row=["2"]))
    opt = getattr(torch.optim, name)(lin.parameters(), **OPTIMIZERS[name])
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)

    def step(x):
        loss = lin(x).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(lin.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return lin, step, sched


def _step_of(model, opt, total):
    """A training step: the squared output's ``total`` (torch.sum, torch.mean), backward, the step."""
    def step(x):
        loss = total(model(x).pow(2))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_compiled_step_reads_the_schedule_with_one_capture(p1, name):
    """Tensor parallel on 4 ranks with clipping and a cosine schedule: 6 compiled calls are one capture,
    no warning, and equal the eager steps (the forward and backward within float64 rounding of the
    eager ones: tests/actor_rt/compile_helpers.py)."""
    m_e, step_e, sched_e = _training(name, p1)
    m_c, step_c, sched_c = _training(name, p1)
    g = gt.compile(step_c)
    gen = torch.Generator().manual_seed(7)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for s in range(6):
            x = gt.distribute(torch.randn(8, 6, dtype=torch.float64, generator=gen), p1, B)
            assert_close_rel(g(x), step_e(x), f"step {s}: loss")
            assert_parameters_close(m_c, m_e, f"step {s}")
            sched_e.step()
            sched_c.step()
    assert g.captures == 1
    assert [t.name for t in g.plan.tasks if "update on pieces" in t.name] == [
        next(t.name for t in g.plan.tasks if f"{name} update on pieces" in t.name)]


def test_a_compiled_zero_optimizer_reads_the_schedule(p2):
    """ZeroOptimizer's wrapped AdamW steps its shards on pieces: a schedule makes no new capture."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        lin = torch.nn.Linear(6, 4).double()
        gt.nn.distribute_module(lin, p2, {})
        opt = gt.nn.ZeroOptimizer(lin.parameters(), torch.optim.AdamW, axis=0, lr=0.05)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        models.append((lin, _step_of(lin, opt, torch.sum), sched))
    (m_e, step_e, sched_e), (m_c, step_c, sched_c) = models
    g = gt.compile(step_c)
    gen = torch.Generator().manual_seed(3)
    for s in range(5):
        x = gt.distribute(torch.randn(8, 6, dtype=torch.float64, generator=gen), p2, (S(0), B))
        g(x)
        step_e(x)
        assert_parameters_close(m_c, m_e, f"step {s}")
        sched_e.step()
        sched_c.step()
    assert g.captures == 1


def test_a_grad_scalers_changing_scale_is_read_by_the_graph(p1):
    """A fused AdamW under GradScaler (its skip decision stays on the device: ``grad_scale`` and
    ``found_inf`` go to the fused kernel): the scale grows every 2 steps and backs off at a step whose
    gradient holds an inf; it is a tensor the graph reads and ``update()`` writes, so the 6 calls are one
    capture, each equal to the eager step (the same fused kernel on the same pieces: exact)."""
    sides = []
    for _ in range(2):
        torch.manual_seed(0)
        lin = torch.nn.Linear(6, 3).double()
        gt.nn.distribute_module(lin, p1, {"weight": S(0), "bias": S(0)})
        opt = torch.optim.AdamW(lin.parameters(), lr=0.05, fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)

        def step(x, lin=lin, opt=opt, scaler=scaler):
            loss = lin(x).pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            return loss.detach()
        sides.append((lin, step, scaler))
    (m_e, step_e, scaler_e), (m_c, step_c, scaler_c) = sides
    g = gt.compile(step_c)
    gen = torch.Generator().manual_seed(2)
    scales = []
    for s in range(6):
        x = torch.randn(8, 6, dtype=torch.float64, generator=gen)
        if s == 3:
            x[0, 0] = float("inf")                     # an inf gradient: the step is skipped, the scale halves
        x = gt.distribute(x, p1, B)
        torch.testing.assert_close(g(x).full_tensor(), step_e(x).full_tensor(), rtol=0, atol=0, equal_nan=True)
        assert scaler_c.get_scale() == scaler_e.get_scale()
        scales.append(scaler_c.get_scale())
        for a, b in zip(m_c.parameters(), m_e.parameters()):
            torch.testing.assert_close(a.full_tensor(), b.full_tensor(), rtol=0, atol=0)
    assert max(scales) > scales[0] and scales[3] == scales[2] / 2, scales      # it grew, and backed off at the inf
    assert g.captures == 1


@pytest.mark.parametrize("plan", ["data", "tensor"])
@pytest.mark.parametrize("name", list(WHOLE_OPTIMIZERS))
def test_a_whole_tensor_optimizer_reads_the_schedule_with_one_capture(p1, name, plan):
    """Muon and Adafactor step on whole pieces (data parallel: the parameters as they are; tensor
    parallel: gathered, then written back): one task reading the group's settings at each run, so a
    cosine schedule makes one capture and no warning -- Adafactor's host reads of its step count and
    norms happen inside the task, on each run's pieces -- and the compiled steps equal the eager ones
    (float64 within rounding: compile_helpers)."""
    sides = []
    for _ in range(2):
        torch.manual_seed(0)
        lin = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()
        gt.nn.distribute_module(lin, p1, gt.nn.megatron_plan(column=["0"], row=["2"]) if plan == "tensor" else {})
        params = [p for p in lin.parameters() if p.dim() == 2 or name != "Muon"]
        opt = getattr(torch.optim, name)(params, **WHOLE_OPTIMIZERS[name])
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
        sides.append((lin, _step_of(lin, opt, torch.mean), sched))
    (m_e, step_e, sched_e), (m_c, step_c, sched_c) = sides
    g = gt.compile(step_c)
    gen = torch.Generator().manual_seed(7)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for s in range(6):
            x = gt.distribute(torch.randn(8, 6, dtype=torch.float64, generator=gen), p1, S(0) if plan == "data" else B)
            assert_close_rel(g(x), step_e(x), f"step {s}: loss")
            assert_parameters_close(m_c, m_e, f"step {s}")
            sched_e.step()
            sched_c.step()
    assert g.captures == 1
