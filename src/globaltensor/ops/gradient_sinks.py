"""Where a partial gradient is summed with another partial one anyway: the lookahead that the
backward's op-by-op choice lacks.

In the forward, an op whose signature gives a recorded input a partial gradient -- a
column-parallel matmul's input ``x``: each rank adds its own heads' share of ``x``'s gradient --
marks the autograd node that sums ``x``'s gradient contributions (``x.grad_fn``, past views: each
projection takes its own view of ``x``). In the backward, an op whose output is a contribution
flowing into a marked node (past views again) may leave that output partial on the marked axes at no
cost: the sum is partial anyway and is reduced once, where Megatron's backward all-reduce is.
A few nodes ahead count too (:func:`sink_marks`): a backward that only moves elements (RoPE's
rotated halves) into sinks, and a matrix product's whose input gradient meets a sink and whose
weight, no larger than the gradient coming in, takes a partial gradient to the buckets.

Without it, a projection whose weight a plan leaves broadcast -- GQA's key and value projections
when the kv heads do not divide the ranks -- gets a partial gradient from attention, and the
backward's ``mm(P, B)`` for its input's gradient reduces its input (the activation's gradient at
the projection's width) rather than owe a wider partial output, which in fact costs nothing more.

The backward's marks enter the dispatch cache's key (call_key.py): the sinks of the running
autograd node, as ``(gradient shape, placement, axes)`` of each marked edge.
"""
from __future__ import annotations

import torch

from ..sbp.shape import numel

MARK = "globaltensor.partial_gradient"
SINKS = "globaltensor.sinks"
#: nodes that pass a gradient on to one input, linearly and with no sum of their own: a mark looks past them
_PASS_THROUGH = frozenset({
    "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "TBackward0", "TransposeBackward0",
    "PermuteBackward0", "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2",
    "AliasBackward0", "CloneBackward0"})
#: backward nodes that move the incoming gradient's elements to their inputs, summing none
_MOVES_ELEMENTS = frozenset({"CatBackward0", "SliceBackward0", "NegBackward0", "SplitBackward0",
                             "SplitWithSizesBackward0", "UnbindBackward0", "StackBackward0", "SelectBackward0"})
#: backward nodes of a matrix product: its input gradient and its weight gradient, each linear in the incoming one
_PRODUCTS = frozenset({"MmBackward0"})
_LEAF = "torch::autograd::AccumulateGrad"
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
    """The edges of ``node`` into a sink, but those whose gradient shape an edge into none shares (an
    output of that shape may be that edge's)."""
    found, elsewhere = [], set()
    for nxt, nr in node.next_functions:
        if nxt is None:
            continue
        shape = tuple(nxt._input_metadata[nr].shape)
        marks = sink_marks(nxt, numel(shape))
        if not marks:
            elsewhere.add(shape)
            continue
        found += [(shape, placement, tuple(sorted(axes))) for placement, axes in marks.items()]
    return tuple(f for f in found if f[0] not in elsewhere) or False


def sink_marks(node, incoming: int, depth: int = 4):
    """``{placement: axes}`` on which a partial gradient of ``incoming`` elements entering ``node``
    is summed with a partial one anyway, or None. A marked node (past views) is such a sink; so,
    ``depth`` nodes deep, is a node that only moves the gradient's elements (a ``cat``'s, a slice's,
    a negation's backward) with every edge into one, and a matrix product's backward with its input
    edge into one and a weight no larger than the gradient: the weight's gradient, partial too, is
    reduced in the gradient buckets at the weight's size (RoPE's backward before GQA's broadcast
    ``k_proj``: the rotated halves, then ``k_proj``, whose input gradient joins ``q_proj``'s)."""
    node = merge_node(node)
    if node is None:
        return None
    marks = node.metadata.get(MARK)
    if marks or depth == 0:
        return marks or None
    name = node.name()
    if name in _MOVES_ELEMENTS:
        return _through(node, depth, largest_leaf=0)
    if name in _PRODUCTS:
        return _through(node, depth, largest_leaf=incoming)
    return None


def _through(node, depth: int, largest_leaf: int):
    """The marks every edge of ``node`` meets (a leaf of at most ``largest_leaf`` elements meets any),
    where some edge meets marks; else None."""
    found = None
    for nxt, nr in node.next_functions:
        if nxt is None:
            continue
        size = numel(nxt._input_metadata[nr].shape)
        merged = merge_node(nxt)
        if merged is not None and merged.name() == _LEAF and size <= largest_leaf and not merged.metadata.get(MARK):
            continue
        marks = sink_marks(nxt, size, depth - 1)
        if not marks:
            return None
        found = marks if found is None else {p: found[p] & a for p, a in marks.items() if p in found and found[p] & a}
        if not found:
            return None
    return found


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
