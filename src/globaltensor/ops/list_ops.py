"""Ops over lists of tensors -- ``_foreach_*``, the fused optimizers, GradScaler's unscale -- as one
local call per group of elements.

An element is the i-th tensor of every list argument (a parameter, its gradient, its optimizer
states). Each element gets target layouts first:

- a ``_foreach_*`` op: those of its per-tensor op (``_foreach_add_`` -> ``add_``) as the
  dispatcher chooses them for that element alone -- the same signature, boxing and kept
  layouts as ``p.add_(g)``;
- a fused optimizer (``_fused_adam_``, ``_fused_adamw_``, ``_fused_sgd_``, ``_fused_adagrad_``):
  the parameter's layout, partial axes as broadcast, for every tensor of the element (the
  update is elementwise but not linear);
- ``_amp_foreach_non_finite_check_and_unscale_``: each gradient's own (the unscale is linear).

Elements in their targets already cost nothing; others are boxed. The elements are then grouped
by the placement, device and dtype of their targets, and each group runs as ONE call of the op
per device over the pieces of every rank this process holds there (a simulated world's ranks
share one call). Per-element number lists (``ScalarList``) follow their elements. An element
whose per-tensor op has no plain signature (a kernel, a decomposition, the fallback) runs on its
own through the dispatcher.

Every argument the op writes is kept (op_record.py): an element written in a boxed copy is boxed
back into the caller's layout and copied in, and written copy-views put their value back into
their bases. ``found_inf`` of the unscale is one plain tensor per device: each call sets it where
its pieces hold an inf or NaN, and in a process world it is then summed over the ranks of the
gradients' placements and clamped to 1 -- every rank takes the same skip decision, and an inf on
one rank's piece counts for the whole tensor.
"""
from __future__ import annotations

import importlib
from operator import attrgetter, itemgetter
from typing import Callable, Dict, List, Optional

import torch

from ..boxing import Layout
from ..comm import current as _current
from ..comm import get_world
from ..sbp import broadcast
from ..tensor import GlobalTensor, box, replicate, wrap_result, write_into
from .boxed_copy import box_input
from .args import get
from .foreach import element_call
from .interned import intern
from .local_run import LocalRun
from .op_record import record
from .viewwrite import propagate

_LAYOUT_OF = attrgetter("_layout")
_PIECES_OF = attrgetter("_pieces")
_VIEW_OF = attrgetter("_view_of")
FUSED = frozenset({"_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"})
UNSCALE = "_amp_foreach_non_finite_check_and_unscale_"


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


class _Slot:
    """One argument of the call: where it is, whether it holds one value per element, whether those
    are tensors (all global ones: ``all_global``) and whether the op writes them."""
    __slots__ = ("where", "key", "name", "per_element", "tensors", "all_global", "written")

    def __init__(self, where, key, name, per_element, tensors, all_global, written):
        self.where, self.key, self.name = where, key, name
        self.per_element, self.tensors, self.all_global, self.written = per_element, tensors, all_global, written

    def get(self, args, kwargs):
        return args[self.key] if self.where == 0 else kwargs[self.key]


class ListRun:
    """A decided list op: each element's targets, the groups, and the elements run on their own."""

    def __init__(self, func, kind: str, slots: List[_Slot], n: int, targets: dict, shared: dict, groups: list,
                 solo: list, out_layouts: Optional[dict]):
        self.func, self.call, self.kind = func, func._op, kind
        self.slots, self.n = slots, n
        # targets: (slot index, element) -> Layout, or None for a plain tensor kept as is
        self.checks = [(s, [(i, t) for (k, i), t in targets.items() if k == s and t is not None])
                       for s in range(len(slots))]
        self.checks = [(s, pairs) for s, pairs in self.checks if pairs]
        # a slot whose every element has a target, listed in element order: checked in one comparison
        self.whole = {s: [t for _, t in pairs] for s, pairs in self.checks if [i for i, _ in pairs] == list(range(n))}
        self.view_checked = [s for s, slot in enumerate(slots) if slot.written and slot.per_element and slot.tensors]
        self.shared = shared                # slot index -> Layout of a shared global tensor (broadcast), or None
        self.groups = groups                # [(placement, [elements])]
        self.solo = solo                    # elements run through the dispatcher one by one
        self.out_layouts = out_layouts      # element -> Layout of its result (ops returning a list), else None
        self._world = None

    # -- running ------------------------------------------------------------------------
    def __call__(self, args, kwargs):
        if _current._world is not self._world:
            self._held()
        given_found = None
        if self.kind == "unscale":
            args, kwargs, given_found = self._plain_found_inf(args, kwargs)
        values, boxed = self._inputs(args, kwargs)
        results: Dict[int, dict] = {}
        for placement, elements in self.groups:
            for device, ranks in self._devices[placement]:
                self._run_group(args, kwargs, values, elements, device, ranks, results)
        if self.kind == "unscale":
            self._agree_found_inf(args, kwargs, given_found)
        self._write_back(args, kwargs, boxed)
        solo = {i: self._run_solo(args, kwargs, i) for i in self.solo}
        if self.out_layouts is None:
            return None
        return [solo[i] if i in solo else self._wrap(i, results.get(i, {})) for i in range(self.n)]

    def _inputs(self, args, kwargs) -> tuple:
        """Every element tensor in its target layout: ``{(slot, element): GlobalTensor}`` for those
        not already there (boxed, or a plain tensor made global), and the boxed written ones."""
        values, boxed = {}, []
        slots = self.slots
        for s, pairs in self.checks:
            given = slots[s].get(args, kwargs)
            whole = self.whole.get(s)
            if whole is not None and slots[s].all_global and list(map(_LAYOUT_OF, given)) == whole:
                continue            # list == compares by identity first: the interned targets, in C
            for i, target in pairs:
                v = given[i]
                if type(v) is GlobalTensor:
                    if v._layout is target:
                        continue
                    if v._layout == target:
                        v._layout = target
                        continue
                    values[s, i] = b = box_input(v, target)
                    if slots[s].written:
                        boxed.append((v, b))
                else:
                    values[s, i] = box(replicate(v, target.placement), target)
        return values, boxed

    def _run_group(self, args, kwargs, values, elements, device, ranks, results) -> None:
        a, kw = list(args), dict(kwargs)
        for s, slot in enumerate(self.slots):
            v = slot.get(args, kwargs)
            if slot.per_element:
                v = self._element_values(s, slot, v, values, elements, ranks)
            elif slot.tensors:
                v = self._shared_value(s, v, device)
            else:
                continue
            if slot.where == 0:
                a[slot.key] = v
            else:
                kw[slot.key] = v
        out = self.call(*a, **kw)
        if self.out_layouts is not None:
            k = 0
            for r in ranks:
                for i in elements:
                    results.setdefault(i, {})[r] = out[k]
                    k += 1

    def _element_values(self, s: int, slot: _Slot, v, values, elements, ranks):
        """The slot's values of the group's elements, rank after rank."""
        if isinstance(v, torch.Tensor):                      # a ``scalars`` tensor: one number per element
            picked = v[list(elements)]
            return torch.cat([picked] * len(ranks)) if len(ranks) > 1 else picked
        if not slot.tensors:
            return [v[i] for _ in ranks for i in elements]
        if slot.all_global and not values:
            picked = v if len(elements) == len(v) else [v[i] for i in elements]
            pieces = list(map(_PIECES_OF, picked))
            return [p for r in ranks for p in map(itemgetter(r), pieces)]
        out = []
        for n, r in enumerate(ranks):
            for i in elements:
                t = values.get((s, i))
                if t is None:
                    t = v[i]
                if type(t) is GlobalTensor:
                    out.append(t._pieces[r])
                elif isinstance(t, torch.Tensor) and slot.written and n > 0:
                    out.append(t.clone())           # a plain tensor written once per rank: one rank writes it
                else:
                    out.append(t)
        return out

    def _shared_value(self, s: int, v, device):
        """A tensor argument shared by every element (a scalar tensor ``lr``, ``found_inf``): its
        broadcast value on ``device``."""
        if type(v) is GlobalTensor:
            target = self.shared[s]
            whole = v if v._layout == target else box(v, target)
            return next(p for r, p in whole._pieces.items() if p.device == device)
        if isinstance(v, torch.Tensor) and v.device != device:
            return v.to(device)
        return v

    def _plain_found_inf(self, args, kwargs) -> tuple:
        """A global ``found_inf`` (GradScaler's is plain) as a plain tensor of its whole value for the
        calls: ``(args, kwargs, the global one or None)``."""
        slot = next(s for s in self.slots if s.name == "found_inf")
        found = slot.get(args, kwargs)
        if type(found) is not GlobalTensor:
            return args, kwargs, None
        whole = box(found, found._layout.with_sbp((broadcast,) * found.placement.ndim))
        plain = next(iter(whole._pieces.values())).clone()
        if slot.where == 0:
            args = args[:slot.key] + (plain,) + args[slot.key + 1:]
        else:
            kwargs = dict(kwargs, **{slot.key: plain})
        return args, kwargs, found

    def _agree_found_inf(self, args, kwargs, given=None) -> None:
        """In a process world: ``found_inf`` summed over the gradients' ranks and clamped to 1; then, for
        a global one, the value written into its own layout."""
        world = get_world()
        found = next(slot for slot in self.slots if slot.name == "found_inf").get(args, kwargs)
        ranks = tuple(sorted({r for placement, _ in self.groups for r in placement.rank_list()}))
        if not world.simulated and ranks and any(world.holds(r) for r in ranks):
            summed = world.all_reduce(ranks, {r: found.detach().clone() for r in world.local_ranks if r in ranks})
            with torch.no_grad():
                found.copy_(next(iter(summed.values())).clamp_(max=1))
        if given is not None:
            write_into(given, found)

    def _write_back(self, args, kwargs, boxed) -> None:
        """Written elements boxed into a copy: the copy back into the caller's layout; copy-views
        into their bases."""
        for orig, copy in boxed:
            write_into(orig, copy)
        for s in self.view_checked:
            given = self.slots[s].get(args, kwargs)
            if self.slots[s].all_global and not any(map(_VIEW_OF, given)):
                continue
            for t in given:
                if type(t) is GlobalTensor and t._view_of is not None:
                    propagate(t)

    def _run_solo(self, args, kwargs, i: int):
        op, a, kw = element_call(self.func, args, kwargs, i, self.n)
        return op(*a, **kw)

    def _wrap(self, i: int, pieces: dict):
        layout = self.out_layouts[i]
        piece = next(iter(pieces.values()), None)
        if piece is None:
            return GlobalTensor(layout, pieces)
        return wrap_result(layout, pieces, self._device_of[layout.placement], piece)

    def _held(self) -> None:
        """Per placement: ``[(device, [ranks held here on it])]``, in rank order."""
        world = self._world = get_world()
        self._devices, self._device_of = {}, {}
        placements = {p for p, _ in self.groups} | {lay.placement for lay in (self.out_layouts or {}).values()}
        for placement in placements:
            by_device: Dict[torch.device, list] = {}
            for r in placement.rank_list():
                if world.holds(r):
                    by_device.setdefault(world.device(placement.type, r), []).append(r)
            self._devices[placement] = list(by_device.items())
            self._device_of[placement] = next(iter(by_device), None)


# -- deciding ---------------------------------------------------------------------------------

def decide_list_op(func, kind: str, args, kwargs, decide_element: Callable) -> ListRun:
    """The ListRun of this call. ``decide_element(op, args, kwargs)`` is the dispatcher's decision
    for one element's per-tensor op (a LocalRun when the op runs as itself on each piece)."""
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
    return ListRun(func, kind, slots, n, targets, shared, groups, solo, outs)


def _slots(func, args, kwargs, written: set) -> tuple:
    """The call's arguments as slots; the element count is the first tensor list's length."""
    arguments = func._schema.arguments
    values = [(0, i, v, arguments[i].name if i < len(arguments) else "") for i, v in enumerate(args)]
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
        slots.append(_Slot(where, key, name, is_list or scalars, tensors, all_global, name in written))
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
    returns = bool(func._schema.returns)
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
    if not isinstance(run, LocalRun) or run.kernel is not None or run.local is not None \
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


def install_foreach_support() -> None:
    """``torch.optim`` takes its default foreach path (and ``clip_grad_norm_`` its foreach norm) only
    for tensor types in its ``_foreach_supported_types`` lists: global tensors join them, as
    DTensor does, so an optimizer over global parameters runs the list ops above."""
    for name in ("torch.optim.optimizer", "torch.utils._foreach_utils"):
        types = getattr(importlib.import_module(name), "_foreach_supported_types", None)
        if isinstance(types, list) and GlobalTensor not in types:
            types.append(GlobalTensor)
