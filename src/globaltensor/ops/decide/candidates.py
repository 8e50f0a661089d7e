"""The second stage of a decision: the nd-signatures a rule admits for this call.

The rule's candidates for one placement axis; those of them that hold in any order of their split
dims' indices (``Rule.order_free``) in each split kind the inputs hold (sbp/split_kinds.py: blocked,
head-tail -- the framework's, not the rule's, to know); and the all-broadcast one; combined over the
placement's axes, then kept where they pass the filters of decide/filters.py (a written tensor keeps
its layout, blocked and head-tail splits lay out their tensors and cut chunks of one size, the
rule's ``admit``, a ``check_shapes`` rule's pieces).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ...boxing import Layout
from ...placement import Placement
from ...sbp import all_broadcast, as_signature, broadcast, nd_candidates
from ...sbp.split_kinds import kind_variants, kinds_held
from ...tensor import GlobalTensor
from ..gradient_sinks import current_sinks, sunk_outputs
from ..kept_boxed_copy import copy_layout
from ..writes.written_inputs import returned_inputs, written_objects
from .filters import Call, admitted
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
    sunk: frozenset = frozenset()   # (output, axis): a partial output a gradient sink sums anyway (gradient_sinks.py)


def candidates(r: Route, func, args, kwargs, recording) -> Problem:
    """The admissible nd-signatures of a ``rule`` route; ``recording``: whether autograd records
    the op (True / False, or "inside" a decomposition of an op it records)."""
    rule, tensors, placement = r.rule, r.tensors, r.placement
    meta_args, meta_kwargs = r.meta_args, r.meta_kwargs
    outs = [r.meta_out] if r.out_kind == "tensor" else \
        [o for o in r.meta_out if isinstance(o, torch.Tensor)] if r.out_kind != "none" else []
    in_layouts = [t._layout if isinstance(t, GlobalTensor) else
                  Layout(tuple(t.shape), t.dtype, placement, (broadcast,) * placement.ndim) for t in tensors]
    plain = [as_signature(c) for c in rule.candidates(*meta_args, **meta_kwargs)]
    kinds = kinds_held(lay.nd_sbp for lay in in_layouts)
    per_axis = [c for c in plain + in_kinds(rule, plain, kinds, meta_args, meta_kwargs)
                + [all_broadcast(len(tensors), len(outs))]
                if len(c.inputs) == len(tensors) and len(c.outputs) == len(outs)]
    inside = recording == "inside"
    recorded = [inside or (bool(recording) and t.requires_grad) for t in tensors]
    written_ids = {id(v) for v in written_objects(func, args, kwargs)}
    written = [k for k, t in enumerate(tensors) if id(t) in written_ids]
    returned = returned_inputs(func, args, kwargs, tensors)
    out_meta = [(tuple(o.shape), o.dtype) for o in outs]
    call = Call(func, args, kwargs, r.positions, rule, placement, in_layouts, out_meta, written, returned)
    sunk = sunk_outputs(current_sinks(), out_meta, placement) if recording is False else frozenset()
    return Problem(in_layouts, out_meta, recorded, [copy_layout(t) if type(t) is GlobalTensor else None
                                                     for t in tensors], written, returned,
                   admitted(nd_candidates([per_axis] * placement.ndim), call), placement, rule.kernel_bytes, sunk)


def in_kinds(rule, plain: list, kinds: list, meta_args, meta_kwargs) -> list:
    """The rule's candidates that hold in any order (``Rule.order_free``), with the ones that block a
    split of their own, in each of ``kinds`` (sbp/split_kinds.py); none for a rule whose candidates
    all read positions."""
    if not kinds or not rule.takes_kinds:
        return []
    free = rule.order_free(plain, meta_args, meta_kwargs)
    own_blocked = [c for c in plain if any(v.is_split and v.blocks > 1 for v in c.inputs + c.outputs)]
    return kind_variants(free + own_blocked, kinds)
