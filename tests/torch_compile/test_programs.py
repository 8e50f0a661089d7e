"""torch.compile on global tensors in a simulated world: examples/gpt.py's forward and backward with each
layout of the how-tos (Megatron-SP's activation entries included) compile into one graph with
``fullgraph=True`` (no graph break) and equal the eager global run in float64; the graph holds only
the pieces' ops.

GlobalTensor is a traceable wrapper subclass (``__tensor_flatten__``: one inner tensor per rank
this process holds), so Dynamo leaves the library's Python alone and AOTAutograd traces the
dispatcher's decision for each op once, with fake pieces.
"""
from __future__ import annotations

import pytest
import torch

import globaltensor as gt
import globaltensor.nn as gnn
from dynamo_helpers import backward_in_compile, counting_backend, graphs_and_breaks
from gpt import TENSOR_PARALLEL, GPT, GPTConfig, make_batch

S, B = gt.sbp.split, gt.sbp.broadcast
CFG = GPTConfig(n_layer=1)         # one block: a second adds no op the first lacks, and doubles the trace
LAYOUTS = {
    # name: (placement ranks, plan maker, nd-SBP of the batch)
    "dp": ([0, 1, 2, 3], lambda: None, (S(0),)),
    "tp": ([0, 1, 2, 3], lambda: gnn.megatron_plan(**TENSOR_PARALLEL), (B,)),
    "hybrid": ([[0, 1], [2, 3]], lambda: gnn.megatron_plan(**TENSOR_PARALLEL, axis=1, ndim=2), (S(0), B)),
    "fsdp": ([0, 1, 2, 3], lambda: {"wte.weight": B, "wpe.weight": B, "*.weight": S(0), "*.bias": S(0)}, (S(0),)),
    "loss_parallel": ([0, 1, 2, 3], lambda: gnn.megatron_plan(**TENSOR_PARALLEL, extra={"lm_head.weight": S(0)}), (B,)),
    "context_parallel": ([0, 1, 2, 3], lambda: None, (S(1, order="head_tail"),)),
    # Megatron-SP: the activation entries' hooks trace into the graph (nn/activation_layouts.py)
    "megatron_sp": ([0, 1, 2, 3], lambda: gnn.megatron_plan(**TENSOR_PARALLEL, sequence_parallel=True), (S(1),)),
    "hybrid_sp": ([[0, 1], [2, 3]], lambda: gnn.megatron_plan(**TENSOR_PARALLEL, axis=1, ndim=2, sequence_parallel=True),
                  (S(0), S(1))),
}


def _model(layout: str, base):
    ranks, plan, batch_sbp = LAYOUTS[layout]
    p = gt.placement("cpu", ranks)
    m = GPT(CFG)
    m.load_state_dict(base.state_dict())
    made = plan()
    gnn.distribute_module(m, p, made) if made is not None else gnn.distribute_module(m, p)
    return m, p, batch_sbp


def _grads(m) -> list:
    return [q.grad.full_tensor() for q in m.parameters()]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gpt_forward_and_backward_compile_into_one_graph_equal_to_eager(world4, layout):
    torch.manual_seed(0)
    base = GPT(CFG)
    idx, tgt = make_batch(CFG, 8, 16, torch.Generator().manual_seed(1))
    m_e, p, batch_sbp = _model(layout, base)
    m_c, _, _ = _model(layout, base)
    i, t = gt.distribute(idx, p, batch_sbp), gt.distribute(tgt, p, batch_sbp)
    compiled = torch.compile(m_c.loss, fullgraph=True, backend="aot_eager")     # one graph, or it raises
    for step in range(2):
        for q in (*m_e.parameters(), *m_c.parameters()):
            q.grad = None
        want, got = m_e.loss(i, t), compiled(i, t)
        want.backward()
        got.backward()
        # float64; the compiled graph runs the eager run's ops on the same pieces
        torch.testing.assert_close(got.full_tensor(), want.full_tensor(), rtol=1e-12, atol=0)
        for a, b in zip(_grads(m_c), _grads(m_e)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
        assert [q.grad.sbp for q in m_c.parameters()] == [q.grad.sbp for q in m_e.parameters()]


@pytest.mark.skipif(not backward_in_compile(), reason="this torch traces no Tensor.backward() inside torch.compile "
                                                      "(torch._dynamo.config.trace_autograd_ops, torch 2.13 on)")
def test_backward_inside_the_compiled_function(world4):
    torch.manual_seed(0)
    base = GPT(CFG)
    idx, tgt = make_batch(CFG, 8, 16, torch.Generator().manual_seed(1))
    m_e, p, batch_sbp = _model("hybrid", base)
    m_c, _, _ = _model("hybrid", base)
    i, t = gt.distribute(idx, p, batch_sbp), gt.distribute(tgt, p, batch_sbp)

    def fwbw(m):
        def run(i, t):
            loss = m.loss(i, t)
            loss.backward()
            return loss.detach()
        return run
    for q in m_c.parameters():
        q.grad = None
    # fullgraph=True: one graph, or it raises
    want, got = fwbw(m_e)(i, t), torch.compile(fwbw(m_c), fullgraph=True, backend="aot_eager")(i, t)
    torch.testing.assert_close(got.full_tensor(), want.full_tensor(), rtol=1e-12, atol=0)
    for a, b in zip(_grads(m_c), _grads(m_e)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_a_split_mlp_is_one_graph_of_piece_ops(p1):
    """The 3-layer MLP of the issue (Linear, GELU, Linear; column then row split): one graph, whose
    nodes are aten ops on the pieces -- four ranks' -- and the sums that reduce the partial output."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    gnn.distribute_module(mlp, p1, {"0.weight": S(0), "0.bias": S(0), "2.weight": S(1)})
    x = gt.distribute(torch.randn(4, 8), p1, B)
    graphs, breaks, reasons = graphs_and_breaks(mlp, x)
    assert (graphs, breaks) == (1, 0), reasons
    seen = []

    def backend(gm, example_inputs):
        from torch._functorch.aot_autograd import aot_module_simplified

        def keep(g, _):
            seen.append(g)
            return g.forward
        return aot_module_simplified(gm, example_inputs, fw_compiler=keep)
    compiled = torch.compile(mlp, fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(x).full_tensor(), mlp(x).full_tensor(), rtol=1e-12, atol=0)
    targets = [n.target for g in seen for n in g.graph.nodes if n.op == "call_function"]
    assert targets and all(str(t).startswith("aten.") for t in targets), targets
    assert sum(str(t).startswith("aten.mm") or str(t).startswith("aten.addmm") for t in targets) >= 8, \
        "each of the 4 ranks multiplies its pieces, twice"


def test_inductor_compiles_the_mlp(recwarn):
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    with gt.simulate(2):        # two ranks: Inductor compiles each rank's kernels
        p = gt.placement("cpu", [0, 1])
        gnn.distribute_module(mlp, p, {"0.weight": S(0), "0.bias": S(0), "2.weight": S(1)})
        x = gt.distribute(torch.randn(4, 8), p, B)
        got = torch.compile(mlp, fullgraph=True)(x)
        # float64; Inductor fuses the pointwise ops (GELU) into other loops: rounding of a few operations
        torch.testing.assert_close(got.full_tensor(), mlp(x).full_tensor(), rtol=1e-10, atol=1e-12)
    # the AOTAutograd cache's key of a global input is ours (compat/aot_cache.py), not torch's fallback
    assert not [w for w in recwarn if "_stable_hash_for_caching" in str(w.message)]


def _adamw_step(model, loss_of):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)

    def step(*batch):
        loss = loss_of(*batch)
        loss.backward()
        loss = loss.detach()        # before opt.step's graph break: docs/traced.md says why
        opt.step()
        opt.zero_grad()
        return loss
    return step


@pytest.mark.skipif(not backward_in_compile(), reason="this torch traces no Tensor.backward() inside torch.compile "
                                                      "(torch._dynamo.config.trace_autograd_ops, torch 2.13 on)")
def test_a_training_step_breaks_where_plain_torch_breaks_and_equals_eager(p1):
    """torch.compile around a whole step with AdamW(foreach): torch.optim breaks the graph around its
    ``step()`` on purpose (torch/optim/optimizer.py ``_use_grad``), on plain tensors alike; global
    tensors add no break of their own, and the steps equal eager's."""
    torch.manual_seed(0)
    base = GPT(CFG)
    idx, tgt = make_batch(CFG, 8, 16, torch.Generator().manual_seed(1))
    plain = GPT(CFG)
    plain.load_state_dict(base.state_dict())
    backend, plain_graphs = counting_backend()
    torch.compile(_adamw_step(plain, plain.loss), backend=backend)(idx, tgt)
    m_e, p, batch_sbp = _model("dp", base)
    m_c, _, _ = _model("dp", base)
    i, t = gt.distribute(idx, p, batch_sbp), gt.distribute(tgt, p, batch_sbp)
    backend, graphs = counting_backend()
    eager, compiled = _adamw_step(m_e, m_e.loss), torch.compile(_adamw_step(m_c, m_c.loss), backend=backend)
    for _ in range(3):
        torch.testing.assert_close(compiled(i, t).full_tensor(), eager(i, t).full_tensor(), rtol=1e-12, atol=0)
    assert len(graphs) == len(plain_graphs) > 1, "the graphs between torch.optim's breaks, no more"
    # AdamW divides a gradient's last-bit differences by sqrt(v) + eps (tests/training/training_helpers.py)
    for a, b in zip(m_c.parameters(), m_e.parameters()):
        torch.testing.assert_close(a.full_tensor(), b.full_tensor(), rtol=1e-9, atol=1e-9)
