"""Traced mode: ``gt.compile(fn)`` captures ``fn`` into a static graph run by a thread-per-stream
actor runtime with credit-based flow control.

    capture.py      record the same eager dispatch (piece ops, collectives, random keys) into a graph
    lower.py        the per-rank task graph: streams, static orders, registers, ordering edges
    runtime.py      one thread per stream, actors with ready / ack counters, CUDA streams and events
    compiled.py     gt.compile: per-meta graphs, warm-up, micro-batches, pipeline, outputs
    graph_views.py  g.plan, g.to_dot(), g.trace_to(path)
"""
from .capture import CaptureError
from .compiled import CompiledFunction, compile
from .program import CompileError
from .runtime import GraphError

__all__ = ["compile", "CompiledFunction", "CaptureError", "CompileError", "GraphError"]
