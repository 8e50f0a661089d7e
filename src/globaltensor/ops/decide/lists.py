"""Deciding an op over lists of tensors -- ``_foreach_*``, the fused optimizers, GradScaler's unscale --
as one local call per group of elements (the executor runs it: ops/executor/lists.py).

An element is the i-th tensor of every list argument (a parameter, its gradient, its optimizer
states). Each element gets target layouts first:

- a ``_foreach_*`` op: those of its per-tensor op (``_foreach_add_`` -> ``add_``) as the
  dispatcher chooses them for that element alone -- the same signature, boxing and kept
  layouts as ``p.add_(g)``;
- a fused optimizer (``_fused_adam_``, ``_fused_adamw_``, ``_fused_sgd_``, ``_fused_adagrad_``):
  the parameter's layout, partial axes as broadcast, for every tensor of the element (the
  update is elementwise but not linear);
- ``_amp_foreach_non_finite_check_and_unscale_``: each gradient's own (the unscale is linear).

The elements are then grouped by the placement, device and dtype of their targets. An element
whose per-tensor op has no plain signature (a kernel, a decomposition, the fallback) runs on its
own through the dispatcher.

A ``_foreach_*`` op's per-tensor op is the record's (``_foreach_add_`` -> ``add_``;
``_foreach_maximum_`` -> ``maximum(x, y, out=x)``, there being no ``maximum_``), its overload found
by torch's own resolution for the element's arguments (``add_.Tensor`` for a tensor list,
``add_.Scalar`` for a number): :func:`element_call`. Everything of the list ops is here and in
executor/lists.py, which runs the plan and makes torch's optimizers and clipping take their foreach
paths for global tensors (``install_foreach_support``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

from ...boxing import Layout
from ...sbp import broadcast
from ...tensor import GlobalTensor
from ...boxing.interned import intern
from ..schema.args import get
from ..schema.op_record import record

FUSED = frozenset({"_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"})
UNSCALE = "_amp_foreach_non_finite_check_and_unscale_"


def element_call(func, args, kwargs, i: int, n: int) -> tuple:
    """``(per-tensor OpOverload, args, kwargs)`` of element ``i`` of a ``_foreach_*`` call."""
    rec = record(func)
    packet, capacity, keywords, out_is_self = rec.per_tensor
    names = rec.names
    element = [v[i] if isinstance(v, (list, tuple)) and len(v) == n else
               (v[i].item() if names[k:k + 1] == ("scalars",) and isinstance(v, torch.Tensor) else v)
               for k, v in enumerate(args)]
    kw = dict(kwargs)
    if len(element) > capacity:
        kw.update(zip(keywords, element[capacity:]))
        element = element[:capacity]
    if out_is_self:
        kw["out"] = element[0]
    overload = torch._C._jit_resolve_packet(packet._qualified_op_name, *element, **kw)
    return getattr(packet, overload), tuple(element), kw


def list_kind(func) -> Optional[str]:
    """``"foreach"``, ``"fused"``, ``"unscale"`` for the list ops run here; None for any other op."""
    name = func.overloadpacket.__name__
    if name in FUSED:
        return "fused"
    if name == UNSCALE:
        return "unscale"
    if name.startswith("_foreach_"):
        return "foreach"
    return None


class Slot:
    """One argument of the call: where it is, whether it holds one value per element, whether those
    are tensors (all global ones: ``all_global``; none global: ``all_plain``) and whether the op
    writes them."""
    __slots__ = ("where", "key", "name", "per_element", "tensors", "all_global", "all_plain", "written")

    def __init__(self, where, key, name, per_element, tensors, all_global, all_plain, written):
        self.where, self.key, self.name = where, key, name
        self.per_element, self.tensors, self.written = per_element, tensors, written
        self.all_global, self.all_plain = all_global, all_plain

    def get(self, args, kwargs):
        return args[self.key] if self.where == 0 else kwargs[self.key]


@dataclass
class ListPlan:
    """A list op's decision: each element's targets, the groups, and the elements run on their own."""
    slots: List[Slot]
    n: int                          # the number of elements
    targets: dict                   # (slot index, element) -> Layout, or None for a plain tensor kept as is
    shared: dict                    # slot index -> Layout of a shared global tensor (broadcast)
    groups: list                    # [(placement, [elements])]
    solo: list                      # elements run through the dispatcher one by one
    out_layouts: Optional[dict]     # element -> Layout of its result (ops returning a list), else None


def decide_list(func, kind: str, args, kwargs, decide_element: Callable) -> ListPlan:
    """The plan of this call. ``decide_element(op, args, kwargs)`` is the dispatcher's Decision for
    one element's per-tensor op."""
    rec = record(func)
    written = {a.name for a in rec.written}
    slots, n = _slots(func, args, kwargs, written)
    if kind == "foreach":
        targets, shared, solo, outs = _foreach_targets(func, args, kwargs, slots, n, decide_element)
    else:
        targets, shared, solo, outs = _element_targets(kind, args, kwargs, slots, n), {}, [], None
        for s, slot in enumerate(slots):
            if slot.tensors and not slot.per_element:
                v = slot.get(args, kwargs)
                if isinstance(v, GlobalTensor):
                    shared[s] = intern(v._layout.with_sbp((broadcast,) * v.placement.ndim))
    groups = _groups(slots, n, targets, solo, args, kwargs)
    return ListPlan(slots, n, targets, shared, groups, solo, outs)


def _slots(func, args, kwargs, written: set) -> tuple:
    """The call's arguments as slots; the element count is the first tensor list's length."""
    names = record(func).names
    values = [(0, i, v, names[i] if i < len(names) else "") for i, v in enumerate(args)]
    values += [(1, k, v, k) for k, v in kwargs.items()]
    n = next(len(v) for _, _, v, _ in values if isinstance(v, (list, tuple)) and v
             and any(isinstance(x, torch.Tensor) for x in v))
    slots = []
    for where, key, v, name in values:
        is_list = isinstance(v, (list, tuple)) and len(v) == n and n > 0
        scalars = isinstance(v, torch.Tensor) and name == "scalars" and v.dim() == 1 and len(v) == n
        tensors = (is_list and any(isinstance(x, torch.Tensor) for x in v)) or \
                  (isinstance(v, torch.Tensor) and not scalars)
        all_global = is_list and all(type(x) is GlobalTensor for x in v)
        all_plain = is_list and tensors and not any(isinstance(x, GlobalTensor) for x in v)
        slots.append(Slot(where, key, name, is_list or scalars, tensors, all_global, all_plain, name in written))
    return slots, n


def _element_targets(kind: str, args, kwargs, slots, n: int) -> dict:
    """Fused optimizers: the parameter's layout without partial axes for the whole element;
    the unscale: each gradient's own layout."""
    targets = {}
    lists = [(s, slot.get(args, kwargs)) for s, slot in enumerate(slots) if slot.per_element and slot.tensors]
    for i in range(n):
        lead = lists[0][1][i]
        if not isinstance(lead, GlobalTensor):
            raise TypeError(f"{UNSCALE if kind == 'unscale' else 'fused optimizer'}: element {i} of its first "
                            f"list is a plain {type(lead).__name__}; with global tensors in the list every "
                            f"element must be global")
        nd = lead._layout.nd_sbp if kind == "unscale" else \
            tuple(broadcast if v.is_partial else v for v in lead._layout.nd_sbp)
        for s, values in lists:
            t = values[i]
            if kind == "unscale":
                targets[s, i] = intern(t._layout) if isinstance(t, GlobalTensor) else None
            elif isinstance(t, torch.Tensor) and (isinstance(t, GlobalTensor) or t.dim() > 0):
                targets[s, i] = intern(Layout(tuple(t.shape), t.dtype, lead.placement, nd if t.dim() else
                                              (broadcast,) * lead.placement.ndim))
            else:
                targets[s, i] = None          # a plain scalar tensor (a step count): as it is on every rank
    return targets


def _foreach_targets(func, args, kwargs, slots, n: int, decide_element) -> tuple:
    """Each element's targets from its per-tensor op's decision; elements without a plain one run solo."""
    targets, shared, solo, outs = {}, {}, [], {}
    returns = record(func).n_returns > 0
    for i in range(n):
        op, a, kw = element_call(func, args, kwargs, i, n)
        run = decide_element(op, a, kw)
        chosen = _plain_targets(run, a, kw)
        if chosen is None or (returns and run.out_kind != "tensor"):
            solo.append(i)
            continue
        mine = {}
        for s, slot in enumerate(slots):
            if not slot.tensors:
                continue
            v = slot.get(args, kwargs)
            t = v[i] if slot.per_element else v
            layout = chosen.get(id(t))
            if slot.per_element:
                mine[s, i] = layout
            elif layout is not None:
                want = layout.with_sbp((broadcast,) * layout.placement.ndim)
                if shared.setdefault(s, want) != want:
                    mine = None
                    break
        if mine is None:
            solo.append(i)
            continue
        targets.update(mine)
        if returns:
            outs[i] = run.out_layouts[0]
    return targets, shared, solo, (outs if returns else None)


def _plain_targets(run, a, kw) -> Optional[dict]:
    """``{id(tensor): target layout}`` of an element's decision that runs the op as itself on each
    piece (no kernel, no per-rank rewrite); None otherwise (or where one tensor gets two targets)."""
    if run.route != "local" or run.kernel is not None or run.local is not None \
            or run.out_kind not in ("tensor", "none"):
        return None
    chosen = {}
    for pos, target in zip(run.positions, run.targets):
        t = get(a, kw, pos)
        if chosen.setdefault(id(t), target) != target:
            return None
    return chosen


def _groups(slots, n: int, targets: dict, solo: list, args, kwargs) -> list:
    """``[(placement, [elements])]``: the elements not run solo, by their targets' placement,
    device type and dtype (first-seen order)."""
    lead = next(s for s, slot in enumerate(slots) if slot.per_element and slot.tensors)
    values = slots[lead].get(args, kwargs)
    groups: Dict[tuple, list] = {}
    skip = set(solo)
    for i in range(n):
        if i in skip:
            continue
        layout = targets.get((lead, i))
        if layout is None:
            layout = values[i]._layout
        groups.setdefault((layout.placement, layout.dtype), []).append(i)
    return [(placement, elements) for (placement, _), elements in groups.items()]
