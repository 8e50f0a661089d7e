"""gt.compile on larger simulated meshes: the 2-D hybrid GPT step (data parallel on axis 0, Megatron on
axis 1, AdamW) compiles at 2x2, 4x4 and 8x8 and equals the eager step.

At 4x4 the dispatcher picks the vocabulary-split embedding backward, whose kernel once selected the
gradient rows by a boolean mask (a shape that depends on the ids) and failed the capture; every rule
kernel is now shape-static where its op is (tests/conformance/test_capture_sweep.py sweeps them).
The model and batch are small (examples/gpt.py: vocab 64, 8 heads, n_embd 64, 2 layers; 16 x 16
tokens) so that 64 simulated ranks fit a test.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

import globaltensor as gt
import globaltensor.nn as gnn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import TENSOR_PARALLEL, GPT, GPTConfig, make_batch  # noqa: E402
from nn_models import training_step  # noqa: E402

S, B = gt.sbp.split, gt.sbp.broadcast
CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=8, n_embd=64)


def _step(p, base, batch):
    m = GPT(CFG)
    m.load_state_dict(base.state_dict())
    gnn.distribute_module(m, p, gnn.megatron_plan(**TENSOR_PARALLEL, axis=1, ndim=2))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True)
    idx, tgt = (gt.distribute(t, p, (S(0), B)) for t in batch)
    return m, training_step(m.loss, opt, zero_grad_first=True), (idx, tgt)


@pytest.mark.parametrize("side", [2, 4, 8])
def test_hybrid_gpt_step_compiles_and_equals_eager(side):
    torch.manual_seed(0)
    base = GPT(CFG)
    batch = make_batch(CFG, 16, 16, torch.Generator().manual_seed(1))
    with gt.simulate(side * side):
        p = gt.placement("cpu", [[i * side + j for j in range(side)] for i in range(side)])
        m_e, eager, args = _step(p, base, batch)
        m_c, step, _ = _step(p, base, batch)
        compiled = gt.compile(step)
        for i in range(3):
            want, got = eager(*args), compiled(*args)
            # float64 (conftest): the graph runs the eager step's ops on the same pieces
            torch.testing.assert_close(got.full_tensor(), want.full_tensor(), rtol=1e-12, atol=0,
                                       msg=lambda msg: f"{side}x{side}, step {i}: {msg}")
        assert compiled.captures == 1
        # AdamW divides a gradient's last-bit differences by sqrt(v) + eps where v is tiny
        # (tests/training/training_helpers.py: 1e-9)
        for (name, a), b in zip(m_c.named_parameters(), m_e.parameters()):
            torch.testing.assert_close(a.full_tensor(), b.full_tensor(), rtol=1e-9, atol=1e-9,
                                       msg=lambda msg: f"{side}x{side}, {name}: {msg}")
        assert math.isfinite(float(want.full_tensor()))
