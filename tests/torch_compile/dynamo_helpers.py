"""Helpers of the torch.compile tests."""
from __future__ import annotations


def graphs_and_breaks(fn, *args):
    """``(graph count, break count, break reasons)`` of ``torch._dynamo.explain(fn)(*args)``."""
    import torch._dynamo
    explained = torch._dynamo.explain(fn)(*args)
    torch._dynamo.reset()
    return explained.graph_count, explained.graph_break_count, [str(r.reason) for r in explained.break_reasons]


def backward_in_compile() -> bool:
    """Whether this torch traces ``loss.backward()`` inside a compiled function (2.13 and later)."""
    import torch._dynamo
    return hasattr(torch._dynamo.config, "trace_autograd_ops")


def counting_backend() -> tuple:
    """``(backend, graphs)``: the ``aot_eager`` backend, appending each graph Dynamo hands it to ``graphs``."""
    from torch._dynamo.backends.debugging import aot_eager
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)
    return backend, graphs
