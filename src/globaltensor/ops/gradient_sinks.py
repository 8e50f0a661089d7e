"""Where a partial gradient is summed with another partial one anyway: the lookahead that the
backward's op-by-op choice lacks.

In the forward, an op whose signature gives a recorded input a partial gradient -- a
column-parallel matmul's input ``x``: each rank adds its own heads' share of ``x``'s gradient --
marks the autograd node that sums ``x``'s gradient contributions (``x.grad_fn``, past views: each
projection takes its own view of ``x``). In the backward, an op whose output is a contribution
flowing into a marked node (past views again) may leave that output partial on the marked axes at no
cost: the sum is partial anyway and is reduced once, where Megatron's backward all-reduce is.

Without it, a projection whose weight a plan leaves broadcast -- GQA's key and value projections
when the kv heads do not divide the ranks -- gets a partial gradient from attention, and the
backward's ``mm(P, B)`` for its input's gradient reduces its input (the activation's gradient at
the projection's width) rather than owe a wider partial output, which in fact costs nothing more.

The backward's marks enter the dispatch cache's key (call_key.py): the sinks of the running
autograd node, as ``(gradient shape, placement, axes)`` of each marked edge.
"""
from __future__ import annotations

import torch

MARK = "globaltensor.partial_gradient"
SINKS = "globaltensor.sinks"
#: nodes that pass a gradient on to one input, linearly and with no sum of their own: a mark looks past them
_PASS_THROUGH = frozenset({
    "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "TBackward0", "TransposeBackward0",
    "PermuteBackward0", "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2",
    "AliasBackward0", "CloneBackward0"})
_current_node = torch._C._current_autograd_node


def merge_node(node):
    """``node``, or the node past the view-like nodes before it, where contributions are summed."""
    while node is not None and node.name() in _PASS_THROUGH:
        nexts = node.next_functions
        if len(nexts) != 1:
            break
        node = nexts[0][0]
    return node


def mark(tensor: torch.Tensor, placement, axes: tuple) -> None:
    """Note that ``tensor``'s gradient receives a contribution partial on ``axes`` of ``placement``."""
    node = merge_node(tensor.grad_fn)
    if node is None:
        return
    marks = node.metadata.setdefault(MARK, {})
    marks[placement] = marks.get(placement, frozenset()) | frozenset(axes)


def current_sinks():
    """The running backward node's marked edges, ``((gradient shape, placement, axes), ...)``, or
    False outside a backward node or where it has none (made once per node)."""
    node = _current_node()
    if node is None:
        return False
    meta = node.metadata
    sinks = meta.get(SINKS)
    if sinks is None:
        sinks = meta[SINKS] = _sinks_of(node)
    return sinks


def _sinks_of(node):
    """The marked edges of ``node``, but those whose gradient shape an unmarked edge shares (an output
    of that shape may be the unmarked edge's)."""
    found, unmarked = [], set()
    for nxt, nr in node.next_functions:
        if nxt is None:
            continue
        merged = merge_node(nxt)
        marks = merged.metadata.get(MARK) if merged is not None else None
        shape = tuple(nxt._input_metadata[nr].shape)
        if not marks:
            unmarked.add(shape)
            continue
        found += [(shape, placement, tuple(sorted(axes))) for placement, axes in marks.items()]
    return tuple(f for f in found if f[0] not in unmarked) or False


def sunk_outputs(sinks, out_meta: list, placement) -> frozenset:
    """``(output index, axis)`` of each output partial reduction a sink takes over: an output of a
    marked edge's gradient shape, on the marked placement's axes (an edge whose shape an unmarked
    one shares is no sink: :func:`_sinks_of`)."""
    if not sinks:
        return frozenset()
    return frozenset((j, a) for j, (shape, _) in enumerate(out_meta) for s, p, axes in sinks
                     if s == shape and p == placement for a in axes)


class MarkRun:
    """A runner (ops/executor) that marks, while autograd records, the inputs whose gradient the
    chosen signature makes partial: ``marks`` holds ``(position, axes)``."""
    __slots__ = ("run", "marks", "placement")

    def __init__(self, run, marks: list, placement):
        self.run, self.marks, self.placement = run, marks, placement

    def __call__(self, args, kwargs):
        if torch.is_grad_enabled():
            for (where, i, j), axes in self.marks:
                v = args[i] if where == 0 else kwargs[i]
                t = v if j is None else v[j]
                if t.requires_grad:
                    mark(t, self.placement, axes)
        return self.run(args, kwargs)
