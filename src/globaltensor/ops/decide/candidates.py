"""The second stage of a decision: the nd-signatures a rule admits for this call.

The rule's candidates for one placement axis, the same with every split blocked where the inputs
hold blocked splits (``split(d, blocks=f)``) and the rule declares ``blocked``, the same in head-tail
order where the inputs hold head-tail splits (``head_tail``, or else ``blocked``), and the
all-broadcast one, combined over the placement's axes; then filtered: a written tensor keeps its layout, as an
input and as the output that returns it; blocked splits must lay out their tensors; a
``check_shapes`` rule's pieces must come out as the balanced pieces of its outputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.utils._pytree import tree_flatten

from ...boxing import Layout
from ...placement import Placement
from ...sbp import Signature, Split, all_broadcast, as_signature, broadcast, nd_candidates
from ...sbp.shape import blocks_problem
from ...tensor import GlobalTensor
from ..kept_boxed_copy import copy_layout
from ..schema.args import Substitution
from ..writes.written_inputs import returned_inputs, written_objects
from .route import Route


@dataclass
class Problem:
    """What the cost stage chooses among, for one call of a ``rule`` route."""
    in_layouts: list                # each tensor input's layout (a plain tensor's as broadcast)
    out_meta: list                  # (shape, dtype) of each tensor output
    recorded: list                  # per input: whether autograd records it (its gradient's way back costs)
    kept_copies: list               # per input: the layout of its kept boxed copy (ops/kept_boxed_copy.py), or None
    written: list                   # tensor-input indices of the tensors the op writes
    returned: dict                  # output position -> tensor-input index of a written input it returns
    candidates: list                # the admissible NdSignatures
    placement: Placement
    kernel_bytes: Optional[Callable] = None   # the rule's: what a candidate costs beyond its boxing


def candidates(r: Route, func, args, kwargs, recording) -> Problem:
    """The admissible nd-signatures of a ``rule`` route; ``recording``: whether autograd records
    the op (True / False, or "inside" a decomposition of an op it records)."""
    rule, tensors, placement = r.rule, r.tensors, r.placement
    meta_args, meta_kwargs = r.meta_args, r.meta_kwargs
    outs = [r.meta_out] if r.out_kind == "tensor" else \
        [o for o in r.meta_out if isinstance(o, torch.Tensor)] if r.out_kind != "none" else []
    in_layouts = [t._layout if isinstance(t, GlobalTensor) else
                  Layout(tuple(t.shape), t.dtype, placement, (broadcast,) * placement.ndim) for t in tensors]
    per_axis = [as_signature(c) for c in rule.candidates(*meta_args, **meta_kwargs)]
    counts = sorted({v.blocks for lay in in_layouts for v in lay.nd_sbp if v.is_split and v.blocked})
    orders = sorted({v.blocks for lay in in_layouts for v in lay.nd_sbp if v.is_split and v.head_tail})
    plain = per_axis
    if counts:
        per_axis = per_axis + blocked_variants(rule, plain, counts, meta_args, meta_kwargs)
    if orders:
        per_axis = per_axis + head_tail_variants(rule, plain, orders, meta_args, meta_kwargs)
    per_axis = [c for c in per_axis + [all_broadcast(len(tensors), len(outs))]
                if len(c.inputs) == len(tensors) and len(c.outputs) == len(outs)]
    inside = recording == "inside"
    recorded = [inside or (bool(recording) and t.requires_grad) for t in tensors]
    written_ids = {id(v) for v in written_objects(func, args, kwargs)}
    written = [k for k, t in enumerate(tensors) if id(t) in written_ids]
    returned = returned_inputs(func, args, kwargs, tensors)
    out_meta = [(tuple(o.shape), o.dtype) for o in outs]
    admitted = [c for c in nd_candidates([per_axis] * placement.ndim)
                if all(c.inputs[k] == in_layouts[k].nd_sbp for k in written)
                and all(c.outputs[j] == in_layouts[k].nd_sbp for j, k in returned.items() if j < len(c.outputs))]
    admitted = [c for c in admitted if _blocks_fit(c, in_layouts, out_meta, placement)]
    if orders:
        admitted = [c for c in admitted if _chunks_agree(c, in_layouts, out_meta)]
    if rule.admit is not None:
        admitted = [c for c in admitted if rule.admit(in_layouts, [lay.with_sbp(nd) for lay, nd in zip(in_layouts,
                                                                                                       c.inputs)])]
    if rule.check_shapes:
        admitted = [c for c in admitted if pieces_line_up(func, c, in_layouts, out_meta, args, kwargs, r.positions,
                                                          rule, placement)]
    return Problem(in_layouts, out_meta, recorded, [copy_layout(t) if type(t) is GlobalTensor else None
                                                     for t in tensors], written, returned, admitted, placement,
                   rule.kernel_bytes)


def blocked_variants(rule, per_axis, counts, meta_args, meta_kwargs) -> list:
    """``per_axis`` (or the part ``rule.blocked`` names) with every split blocked ``f`` ways, for each
    ``f`` in ``counts``; nothing for a rule that is not ``blocked``."""
    if not rule.blocked:
        return []
    eligible = per_axis if rule.blocked is True else [as_signature(c) for c in rule.blocked(*meta_args, **meta_kwargs)]
    blocked = lambda vs, f: tuple(Split(v.dim, f) if v.is_split else v for v in vs)
    plain = [c for c in eligible if any(v.is_split for v in c.inputs + c.outputs)
             and not any(v.is_split and v.blocks > 1 for v in c.inputs + c.outputs)]
    return [Signature(blocked(c.inputs, f), blocked(c.outputs, f)) for f in counts for c in plain]


def head_tail_variants(rule, per_axis, counts, meta_args, meta_kwargs) -> list:
    """The candidates that hold in any order of a split dim's indices (``rule.head_tail``, or else
    ``rule.blocked``, and the rule's own blocked ones) in head-tail order: their splits as they are,
    and a plain one's blocked ``f`` ways for each ``f`` in ``counts`` too."""
    which = rule.head_tail if rule.head_tail is not None else rule.blocked
    if not which:
        return []
    eligible = per_axis if which is True else [as_signature(c) for c in which(*meta_args, **meta_kwargs)]
    eligible = eligible + [c for c in per_axis if any(v.is_split and v.blocked for v in c.inputs + c.outputs)]
    turned = lambda vs, f: tuple(Split(v.dim, f or v.blocks, "head_tail") if v.is_split else v for v in vs)
    out = []
    for c in eligible:
        if not any(v.is_split for v in c.inputs + c.outputs):
            continue
        out.append(Signature(turned(c.inputs, 0), turned(c.outputs, 0)))
        if not any(v.is_split and v.blocks > 1 for v in c.inputs + c.outputs):
            out += [Signature(turned(c.inputs, f), turned(c.outputs, f)) for f in counts if f > 1]
    return list(dict.fromkeys(out))


def _blocks_fit(c, in_layouts, out_meta, placement) -> bool:
    """Whether every blocked or head-tail split of the nd-candidate lays out its tensor (sbp/shape.py)."""
    hierarchy = placement.hierarchy
    return not any(blocks_problem(shape, hierarchy, nd)
                   for shape, nd in _shapes_under(c, in_layouts, out_meta)
                   if any(v.is_split and (v.blocks > 1 or v.head_tail) for v in nd))


def _chunks_agree(c, in_layouts, out_meta) -> bool:
    """Whether every head-tail split of the nd-candidate on one placement axis cuts blocks of one size:
    then chunk ``i`` holds the same indices of the dim in every tensor (a merge of ``[b, t]`` into
    ``[b*t]`` keeps ``t``-sized blocks; one of ``[t, h]`` into ``[t*h]`` would not)."""
    sizes = {}
    for shape, nd in _shapes_under(c, in_layouts, out_meta):
        for a, v in enumerate(nd):
            if v.is_split and v.head_tail and sizes.setdefault(a, shape[v.dim] // v.blocks) != shape[v.dim] // v.blocks:
                return False
    return True


def _shapes_under(c, in_layouts, out_meta) -> list:
    """``(shape, nd-SBP)`` of every input and output under the nd-candidate ``c``."""
    return ([(lay.shape, nd) for lay, nd in zip(in_layouts, c.inputs)] +
            [(shape, nd) for (shape, _), nd in zip(out_meta, c.outputs)])


def pieces_line_up(func, c, in_layouts, out_meta, args, kwargs, positions, rule, placement) -> bool:
    """Run the local op on meta pieces of every distinct rank shape; outputs must be balanced pieces."""
    substitute = Substitution(positions)
    targets = [lay.with_sbp(nd) for lay, nd in zip(in_layouts, c.inputs)]
    outs = [Layout(shape, dtype, placement, nd) for (shape, dtype), nd in zip(out_meta, c.outputs)]
    seen = set()
    for r in placement.rank_list():
        shapes = tuple(t.piece_shape(r) for t in targets)
        want = tuple(o.piece_shape(r) for o in outs)
        if (shapes, want) in seen:
            continue
        seen.add((shapes, want))
        a, kw = substitute(args, kwargs, [torch.empty(s, dtype=t.dtype, device="meta")
                                          for s, t in zip(shapes, targets)])
        if rule.local is not None:
            a, kw = rule.local(r, targets, outs, *a, **kw)
        try:
            got = [tuple(t.shape) for t in tree_flatten(func(*a, **kw))[0] if isinstance(t, torch.Tensor)]
        except Exception:
            return False
        if tuple(got) != want:
            return False
    return True

