"""The filters an nd-candidate of a ``rule`` route passes to be admitted (decide/candidates.py).

Each is a named function ``(candidate, call) -> bool`` of the nd-signature and what the call gives
(:class:`Call`); :data:`FILTERS` runs them in order, the cheap ones first, so the last (a meta run
per distinct piece shape) sees only the candidates left.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten

from ...boxing import Layout
from ...placement import Placement
from ...sbp.shape import blocks_problem
from ..registry import Rule
from ..schema.args import Substitution


@dataclass(frozen=True)
class Call:
    """What the filters read of one call: the op and its arguments, where the tensors sit, the rule,
    the inputs' layouts as they come, the outputs' ``(shape, dtype)`` and the written inputs."""
    func: object
    args: tuple
    kwargs: dict
    positions: list
    rule: Rule
    placement: Placement
    in_layouts: list
    out_meta: list
    written: list                   # tensor-input indices of the tensors the op writes
    returned: dict                  # output position -> tensor-input index of a written input it returns


def keeps_written(c, call: Call) -> bool:
    """A tensor the op writes keeps its layout: as an input, and as the output that returns it."""
    return (all(c.inputs[k] == call.in_layouts[k].nd_sbp for k in call.written)
            and all(c.outputs[j] == call.in_layouts[k].nd_sbp for j, k in call.returned.items() if j < len(c.outputs)))


def lays_out_blocks(c, call: Call) -> bool:
    """Every blocked or head-tail split of the candidate lays out its tensor (sbp/shape.py
    ``blocks_problem``: the blocks divide the dim, a head-tail split's chunks are of one size)."""
    hierarchy = call.placement.hierarchy
    return not any(blocks_problem(shape, hierarchy, nd) for shape, nd in shapes_under(c, call)
                   if any(v.is_split and (v.blocks > 1 or v.order != "plain") for v in nd))


def same_chunks(c, call: Call) -> bool:
    """Every split of the candidate in an order other than the plain one cuts chunks of one size on
    its placement axis, in every tensor: then chunk ``i`` holds the same indices of the dim in each
    (a merge of ``[b, t]`` into ``[b*t]`` keeps ``t``-sized chunks apart; one of ``[t, h]`` into
    ``[t*h]`` would not)."""
    if not any(v.is_split and v.order != "plain" for nd in c.inputs + c.outputs for v in nd):
        return True
    sizes = {}
    for shape, nd in shapes_under(c, call):
        for a, v in enumerate(nd):
            if v.is_split and v.order != "plain" and \
                    sizes.setdefault(a, shape[v.dim] // v.blocks) != shape[v.dim] // v.blocks:
                return False
    return True


def admitted_by_rule(c, call: Call) -> bool:
    """The rule's own ``admit`` (a candidate right only for some layouts of the call), where it has one."""
    admit = call.rule.admit
    return admit is None or admit(call.in_layouts, [lay.with_sbp(nd) for lay, nd in zip(call.in_layouts, c.inputs)])


def pieces_line_up(c, call: Call) -> bool:
    """For a ``check_shapes`` rule: the local op, run on meta pieces of every distinct rank shape,
    gives the balanced pieces of the outputs."""
    if not call.rule.check_shapes:
        return True
    placement, rule = call.placement, call.rule
    substitute = Substitution(call.positions)
    targets = [lay.with_sbp(nd) for lay, nd in zip(call.in_layouts, c.inputs)]
    outs = [Layout(shape, dtype, placement, nd) for (shape, dtype), nd in zip(call.out_meta, c.outputs)]
    seen = set()
    for r in placement.rank_list():
        shapes = tuple(t.piece_shape(r) for t in targets)
        want = tuple(o.piece_shape(r) for o in outs)
        if (shapes, want) in seen:
            continue
        seen.add((shapes, want))
        a, kw = substitute(call.args, call.kwargs, [torch.empty(s, dtype=t.dtype, device="meta")
                                                    for s, t in zip(shapes, targets)])
        if rule.local is not None:
            a, kw = rule.local(r, targets, outs, *a, **kw)
        try:
            got = [tuple(t.shape) for t in tree_flatten(call.func(*a, **kw))[0] if isinstance(t, torch.Tensor)]
        except Exception:
            return False
        if tuple(got) != want:
            return False
    return True


def shapes_under(c, call: Call) -> list:
    """``(shape, nd-SBP)`` of every input and output under the nd-candidate ``c``."""
    return ([(lay.shape, nd) for lay, nd in zip(call.in_layouts, c.inputs)] +
            [(shape, nd) for (shape, _), nd in zip(call.out_meta, c.outputs)])


FILTERS = (keeps_written, lays_out_blocks, same_chunks, admitted_by_rule, pieces_line_up)


def admitted(candidates: list, call: Call) -> list:
    """The candidates that pass every filter."""
    for keep in FILTERS:
        candidates = [c for c in candidates if keep(c, call)]
    return candidates
