"""``gt.compile`` around a step whose body calls a ``torch.compile``d module: the capture records the
module's ops like any other global ops, and the graph's steps equal the eager steps."""
from __future__ import annotations

import copy

import torch

import globaltensor as gt
import globaltensor.nn as gnn

S = gt.sbp.split


def _step(base, placement, compiled: bool):
    m = copy.deepcopy(base)
    gnn.distribute_module(m, placement, {"0.weight": S(0), "0.bias": S(0), "2.weight": S(1)})
    module = torch.compile(m, backend="aot_eager") if compiled else m
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def step(x):
        loss = module(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step, m


def test_gt_compile_of_a_step_holding_a_torch_compiled_module_equals_eager(p1):
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    graph_step, graph_model = _step(base, p1, compiled=True)
    graph = gt.compile(graph_step)
    eager, eager_model = _step(base, p1, compiled=False)
    for _ in range(4):
        x = gt.randn(6, 8, placement=p1, sbp=S(0))
        # float64 both sides, the same ops on the same pieces
        assert torch.equal(graph(x).full_tensor(), eager(x).full_tensor())
    assert graph.captures == 1
    for a, b in zip(graph_model.parameters(), eager_model.parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor())
