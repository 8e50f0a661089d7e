"""gt.compile on examples/gpt.py's GPT, 2x2 data x tensor placement, AdamW: the compiled copy (of
examples/demo.py's train_step) trains step by step as the eager one. After every step its loss, every parameter and AdamW's moments equal the
eager copy's, in float64 (see training_helpers.TOL): call 0 runs eagerly, call 1 captures and runs
the graph, calls 2 and 3 run the graph."""
from __future__ import annotations

import copy

import pytest
import torch

import globaltensor as gt
import globaltensor.nn as gnn
from training_helpers import BATCH, CFG, SEQ, TOL, GPT, S, B, default_dtype, make_batch, megatron, train_step

STEPS = 4


@pytest.fixture
def float64():
    """float64 as torch's default dtype: AdamW's step counter takes it, and the compiled (capturable)
    AdamW computes its bias corrections in the counter's dtype."""
    with default_dtype(torch.float64):
        yield


def test_compiled_gpt_trains_as_the_eager_one(p2, float64):
    torch.manual_seed(0)
    eager = GPT(CFG)
    compiled = copy.deepcopy(eager)
    models = (eager, compiled)
    for m in models:
        gnn.distribute_module(m, p2, megatron(axis=1, ndim=2))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.1) for m in models]
    step_e, step_c = train_step(eager, opts[0]), gt.compile(train_step(compiled, opts[1]))
    names = [n for n, _ in eager.named_parameters()]
    data = torch.Generator().manual_seed(1)
    losses = []
    for step in range(STEPS):
        idx, targets = make_batch(CFG, BATCH, SEQ, data)
        args = (gt.distribute(idx, p2, (S(0), B)), gt.distribute(targets, p2, (S(0), B)))
        with gt.comm_stats() as stats_e:
            loss_e = step_e(*args)
        with gt.comm_stats() as stats_c:
            loss_c = step_c(*args)
        assert loss_c.sbp == loss_e.sbp and loss_c.dtype == torch.float64
        torch.testing.assert_close(loss_c.full_tensor(), loss_e.full_tensor(), **TOL,
                                   msg=lambda m: f"step {step}, loss: {m}")
        for name, pc, pe in zip(names, compiled.parameters(), eager.parameters()):
            assert pc.sbp == pe.sbp, f"step {step}: {name} has sbp {pc.sbp}, eager {pe.sbp}"
            torch.testing.assert_close(pc.full_tensor(), pe.full_tensor(), **TOL,
                                       msg=lambda m: f"step {step}, parameter {name}: {m}")
            for key in ("exp_avg", "exp_avg_sq"):
                sc, se = opts[1].state[pc][key], opts[0].state[pe][key]
                assert sc.sbp == se.sbp, (step, name, key)
                torch.testing.assert_close(sc.full_tensor(), se.full_tensor(), **TOL,
                                           msg=lambda m: f"step {step}, {name} {key}: {m}")
        losses.append(loss_e.item())
    assert step_c.captures == 1, f"one argument meta, one capture; got {step_c.captures}"
    # the graph's own collectives: the data-parallel gradients all-reduced in buckets as eager does
    # (distribute_module buckets them), the same bytes
    assert stats_c.bytes_sent == stats_e.bytes_sent and stats_c.count == stats_e.count, (stats_c, stats_e)
    assert losses[-1] < losses[0], f"the model did not train: losses {losses}"
