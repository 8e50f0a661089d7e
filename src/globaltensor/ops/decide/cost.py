"""The third stage of a decision: what each admissible signature costs, and the cheapest.

A candidate costs, in (bytes, boxing steps), the boxing of its inputs -- from a kept boxed copy
where that is the cheaper start -- and the costs that come later, which an eager choice must
count now or pay twice: an input made partial owes the reduction it defers (unless the op's own
contraction sums it), an input autograd records owes its gradient's way back to its layout, and
the outputs owe what the paragraphs below say. A candidate taking the inputs as they are and
owing nothing costs nothing, and the others need not be planned. Ties keep the fewer partial
outputs, then split outputs, then the rule's order (``sbp.choose``).

*Partial outputs.* A partial sum is reduced some time, so a partial output costs its
reduction -- except where the op takes its inputs as they are (or slices broadcast ones, which
is free) and either makes the partial
sum itself from split inputs (``mm(S(1), S(0)) -> P``, the row-parallel layer: that is the
op's own way) or passes partial inputs on without meeting a broadcast tensor (views, copies,
casts, ``neg``, ``sum``, ``add(P, P)``: gradients accumulating, one reduction later for all).
Boxing an input to make a partial output (``mm(P, B)`` as ``(S(1), S(0)) -> P``, after a
reduce-scatter) leaves the reduction still owed. A broadcast input made partial where the op
makes its partial sum from split inputs is free and owes nothing of its own: a row-parallel
``addmm``'s bias joins the partial sum (one rank adds it) and is reduced with it, as in
Megatron (:func:`contracting_axes`). And an op that
meets a partial input with a broadcast tensor (``mul(P, B) -> P``) has not saved the
reduction but moved it on: when the output is the input's size the two tie, and the tie keeps the output unsplit -- reduce now,
once, rather than let the partial sum branch into several such ops that each give a partial
result to reduce (the backward of an RMSNorm multiplies a partial gradient by the weight, by
the normalised input and by the input: three reductions where Megatron has one; reduced at
the first, the others read its kept copy). Where the output is smaller (``sum(P * B)``,
``mm(P, B)`` into fewer features) the reduction waits for it. And where the output is a gradient contribution that
a gradient sink sums with another partial one anyway (ops/gradient_sinks.py: the input gradient of a
projection beside a column-parallel one), it owes nothing: one reduction serves the sum. Integer broadcast inputs are
indices (``embedding_dense_backward(P, ids)``, ``gather``, ``index_select``): they place the
partial values, as a view does: the output's later reduction is counted in bytes (so a table's
gradient larger than the rows it comes from is reduced from the rows, now) but not as a
collective of its own (it joins a gradient bucket), so at equal size the output stays partial:
a data-parallel embedding's gradient joins the bucket instead of being all-reduced, blocking,
inside the backward. A boolean mask combines: ``masked_fill(P, mask, 0)`` is ``P * ~mask``.

*Splits made from unsplit inputs.* An op whose inputs are all unsplit on a placement axis
(broadcast or partial there) may pick a split output: ``add(B, P) -> S(0)`` reduce-scatters
its partial input, half an all-reduce. But the program around it is unsplit on that axis
(its other tensors, its parameters), so the split is gathered back -- and until it is, the
ops that meet it take splits too: activations end up split along the batch under a
tensor-parallel plan, broadcast parameters get partial gradients, weights are gathered
before matmuls. A reduce-scatter plus the all-gather back are the bytes of the all-reduce;
with the way back counted, the choice falls to the fewer collectives.

The same holds where the output is one a gradient sink sums: an input made partial on that axis
(the accumulation of a broadcast gradient contribution with a partial one) joins the sink's sum.

*Gradients.* An input autograd records costs the way back of its gradient, from the layout
the backward gives it (:func:`gradient_under`) to the input's own.
"""
from __future__ import annotations

import torch

from ...boxing import Layout, plan_boxing
from ...sbp import broadcast, choose as least, partial_sum
from ...tensor import gradient_layout
from .candidates import Problem


def choose(problem: Problem, as_they_are: bool = False):
    """The admissible candidate of least cost; ``as_they_are`` (``gt.explicit()``): of those that take
    every input in its layout, where there are any -- a partial result included, which the program
    then reduces where it says so."""
    templates = out_templates(problem)
    kept = [c for c in problem.candidates if all(nd == lay.nd_sbp for lay, nd in zip(problem.in_layouts, c.inputs))]
    exact = [c for c in kept if output_cost(problem.in_layouts, c, templates, problem.sunk) == (0, 0)
             and not _kernel_bytes(problem, c)]
    if exact:
        return least(exact, lambda c: (0, 0))
    return least(kept if as_they_are and kept else problem.candidates, lambda c: cost(problem, c, templates))


def out_templates(problem: Problem) -> list:
    """The outputs' layouts as broadcast: their shapes and dtypes for :func:`output_cost`."""
    b = (broadcast,) * problem.placement.ndim
    return [Layout(shape, dtype, problem.placement, b) for shape, dtype in problem.out_meta]


def cost(problem: Problem, c, templates: list = None) -> tuple:
    """(bytes, boxing steps) of candidate ``c``: boxing its inputs (from a kept copy where that starts
    cheaper), the reduction an input made partial defers (not where the op's own contraction sums
    it), each recorded input's gradient's way back, and what the outputs owe later."""
    total, steps = 0, 0
    absorbed = contracting_axes(c) | sunk_axes(problem.sunk, c)
    for lay, nd, grad, kept in zip(problem.in_layouts, c.inputs, problem.recorded, problem.kept_copies):
        target = lay.with_sbp(nd)
        plans = [plan_boxing(lay, target)]
        if kept is not None:
            plans = [min(plans[0], plan_boxing(kept, target), key=lambda p: p.bytes)]
        if any(v.is_partial and not u.is_partial and a not in absorbed
               for a, (u, v) in enumerate(zip(lay.nd_sbp, nd))):
            plans.append(plan_boxing(target, lay))
        if grad:
            plans.append(plan_boxing(gradient_under(target, c), gradient_layout(lay)))
        total += sum(p.bytes for p in plans)
        steps += sum(len(p.steps) for p in plans)
    later = output_cost(problem.in_layouts, c, out_templates(problem) if templates is None else templates,
                        problem.sunk)
    return total + later[0] + _kernel_bytes(problem, c), steps + later[1]


def _kernel_bytes(problem: Problem, c) -> int:
    """What candidate ``c`` costs beyond its boxing by the rule's own count (ring attention's blocks,
    sdpa's gathered k and v held for the backward), or 0."""
    if problem.kernel_bytes is None:
        return 0
    outs = [Layout(shape, dtype, problem.placement, nd) for (shape, dtype), nd in zip(problem.out_meta, c.outputs)]
    return problem.kernel_bytes(problem.in_layouts, [lay.with_sbp(nd) for lay, nd in zip(problem.in_layouts, c.inputs)],
                                outs, any(problem.recorded))


def output_cost(in_layouts: list, c, out_layouts: list, sunk: frozenset = frozenset()) -> tuple:
    """(bytes, steps) to reduce the partial outputs ``c`` owes (see the module's docstring) and to
    gather back the splits it makes where no input keeps a split (``out_layouts``: the outputs'
    shapes and dtypes); ``sunk``: the ``(output, axis)`` whose partial sum a gradient sink reduces
    with another anyway (gradient_sinks.py), owing nothing."""
    ndim = len(c.outputs[0]) if c.outputs else 0
    kept = {a for a in range(ndim)
            if any(lay.nd_sbp[a].is_split and nd[a] == lay.nd_sbp[a] for lay, nd in zip(in_layouts, c.inputs))}
    contracted = contracting_axes(c)
    exact = all(v == u or (u.is_broadcast and v.is_split)          # as they are, or sliced for free,
                or (u.is_broadcast and v.is_partial and a in contracted)   # or a bias joining a partial sum
                for lay, nd in zip(in_layouts, c.inputs) for a, (u, v) in enumerate(zip(lay.nd_sbp, nd)))
    meets = [a for a in range(ndim) if any(nd[a].is_partial for nd in c.inputs)]
    owed = {a for a in range(ndim) if not exact or (a in meets and any(
        nd[a].is_broadcast and _combines(lay) for lay, nd in zip(in_layouts, c.inputs)))}
    indexed = {a for a in meets if a not in owed and any(nd[a].is_broadcast for nd in c.inputs)}
    total, steps = 0, 0
    for j, (lay, nd) in enumerate(zip(out_layouts, c.outputs)):
        back = tuple(broadcast if (v.is_partial and a in owed | indexed and (j, a) not in sunk)
                     or (v.is_split and a not in kept) else v for a, v in enumerate(nd))
        if back != nd:
            plan = plan_boxing(lay.with_sbp(nd), lay.with_sbp(back))
            total += plan.bytes
            own = tuple(v if v.is_partial and a in indexed else b for a, (v, b) in enumerate(zip(nd, back)))
            steps += len(plan_boxing(lay.with_sbp(nd), lay.with_sbp(own)).steps) if own != nd else 0
    return total, steps


def contracting_axes(c) -> set:
    """The placement axes on which ``c`` makes a partial output out of split inputs (a matrix
    product's contraction): a broadcast input made partial there joins that sum, owing nothing."""
    ndim = len(c.outputs[0]) if c.outputs else 0
    return {a for a in range(ndim) if any(out[a].is_partial for out in c.outputs)
            and any(nd[a].is_split for nd in c.inputs)}


def sunk_axes(sunk: frozenset, c) -> set:
    """The placement axes on which every partial output of ``c`` is summed by a gradient sink
    (gradient_sinks.py): an input made partial there joins that sum, owing nothing."""
    ndim = len(c.outputs[0]) if c.outputs else 0
    return {a for a in range(ndim) if any(out[a].is_partial for out in c.outputs)
            and all((j, a) in sunk for j, out in enumerate(c.outputs) if out[a].is_partial)}


def _combines(layout: Layout) -> bool:
    """Whether a broadcast input of this dtype combines with a partial one rather than only placing
    its values: integer tensors are indices. A boolean mask is a 0/1 factor of the partial values
    (``masked_fill(P, mask, 0)`` is ``P * ~mask``), so it combines."""
    return layout.dtype.is_floating_point or layout.dtype.is_complex or layout.dtype == torch.bool


def gradient_under(target: Layout, c) -> Layout:
    """The layout the backward gives the gradient of an input boxed to ``target`` for signature ``c``.

    Each rank's backward computes its piece's share of the gradient: a split input's gradient
    is split the same way, a partial input's is broadcast (every rank's piece gets the whole
    gradient). A broadcast input of an op whose output is split or partial on that axis --
    ``mm(x S(0), w B) -> S(0)``, an embedding table used by a batch-split lookup -- gets a
    partial gradient there: each rank adds the contribution of its own rows. Counting it as
    broadcast made gathering a weight, or slicing a broadcast input, look free when the
    gradient's reduction comes back every step.
    """
    nd = []
    for a, v in enumerate(target.nd_sbp):
        if v.is_partial:
            nd.append(broadcast)
        elif v.is_broadcast and any(not out[a].is_broadcast for out in c.outputs):
            nd.append(partial_sum)
        else:
            nd.append(v)
    return target.with_sbp(tuple(nd))
