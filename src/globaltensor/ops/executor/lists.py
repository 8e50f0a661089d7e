"""Running a list op's decision (decide/lists.py): each group of elements as ONE call of the op per
device over the pieces of every rank this process holds there (a simulated world's ranks share one
call), per-element number lists (``ScalarList``) following their elements.

Elements in their targets already cost nothing; others are boxed. Every argument the op writes is
kept (schema/op_record.py): an element written in a boxed copy is boxed back into the caller's
layout and copied in, and written copy-views put their value back into their bases. ``found_inf``
of the unscale is one plain tensor per device: each call sets it where its pieces hold an inf or
NaN, and in a process world it is then summed over the ranks of the gradients' placements and
clamped to 1 -- every rank takes the same skip decision, and an inf on one rank's piece counts for
the whole tensor.

The elements run on their own through the dispatcher run in one ``group_reduce.batched()``: the
partial results their kernels combine (``_foreach_norm``'s norms of split gradients) go in one
collective per group of ranks, not one per element.
"""
from __future__ import annotations

import importlib
from operator import attrgetter, itemgetter
from typing import Dict

import torch

from ...comm import current as _current
from ...comm import get_world
from ...sbp import broadcast
from ...tensor import GlobalTensor, box, replicate, wrap_fresh, write_into
from ..kept_boxed_copy import box_input
from ..explicit import explicit, refuse_implicit
from ..decide.decision import Decision
from ..decide.lists import element_call
from ..group_reduce import batched
from ..writes.copy_views import propagate

_LAYOUT_OF = attrgetter("_layout")
_PIECES_OF = attrgetter("_pieces")
_VIEW_OF = attrgetter("_view_of")


class ListRunner:
    """Runs a list op's decision (see the module's docstring)."""

    def __init__(self, d: Decision):
        plan = d.lists
        func, slots, n, targets = d.func, plan.slots, plan.n, plan.targets
        self.func, self.call, self.kind = func, func._op, d.list_kind
        self.slots, self.n = slots, n
        # targets: (slot index, element) -> Layout, or None for a plain tensor kept as is
        self.checks = [(s, [(i, t) for (k, i), t in targets.items() if k == s and t is not None])
                       for s in range(len(slots))]
        self.checks = [(s, pairs) for s, pairs in self.checks if pairs]
        # a slot whose every element has a target, listed in element order: checked in one comparison
        self.whole = {s: [t for _, t in pairs] for s, pairs in self.checks if [i for i, _ in pairs] == list(range(n))}
        self.view_checked = [s for s, slot in enumerate(slots) if slot.written and slot.per_element and slot.tensors]
        # plain tensors every rank takes as they are (the fused optimizers' step counts)
        self.as_given = {s for s, slot in enumerate(slots)
                         if slot.all_plain and all(targets.get((s, i)) is None for i in range(n))}
        self.shared, self.groups, self.solo, self.out_layouts = plan.shared, plan.groups, plan.solo, plan.out_layouts
        if self.out_layouts is not None:
            self.group_layouts = [[self.out_layouts[i] for i in elements] for _, elements in self.groups]
        # the whole list in one group, in order: its wrapped results are the result as they are
        self.one_group = len(self.groups) == 1 and self.groups[0][1] == list(range(n)) and not self.solo
        self._world = None

    def __call__(self, args, kwargs):
        if _current._world is not self._world:
            self._held()
        given_found = None
        if self.kind == "unscale":
            args, kwargs, given_found = self._plain_found_inf(args, kwargs)
        values, boxed = self._inputs(args, kwargs)
        outputs = None if self.out_layouts is None else [None] * self.n
        for g, (placement, elements) in enumerate(self.groups):
            runs = [(device, ranks, self._run_group(args, kwargs, values, elements, device, ranks))
                    for device, ranks in self._devices[placement]]
            if outputs is not None:
                wrapped = self._wrapped(self.group_layouts[g], runs)
                if self.one_group:
                    outputs = wrapped
                else:
                    for i, w in zip(elements, wrapped):
                        outputs[i] = w
        if self.kind == "unscale":
            self._agree_found_inf(args, kwargs, given_found)
        self._write_back(args, kwargs, boxed)
        if self.solo:
            with batched():
                for i in self.solo:
                    result = self._run_solo(args, kwargs, i)
                    if outputs is not None:
                        outputs[i] = result
        return outputs

    def _inputs(self, args, kwargs) -> tuple:
        """Every element tensor in its target layout: ``{(slot, element): GlobalTensor}`` for those
        not already there (boxed, or a plain tensor made global), and the boxed written ones. A plain
        tensor the op only reads, on the placement's device type and taken as broadcast, is every
        rank's piece as it is (the capturable optimizers' step counters: no copy per rank)."""
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
                    if explicit.depth:
                        refuse_implicit(self.func, [v._layout], [target])
                    values[s, i] = b = box_input(v, target)
                    if slots[s].written:
                        boxed.append((v, b))
                elif slots[s].written or v.device.type != target.placement.type or \
                        not all(x.is_broadcast for x in target.nd_sbp):
                    if explicit.depth:
                        refuse_implicit(self.func, [None], [target])
                    values[s, i] = box(replicate(v, target.placement), target)
        return values, boxed

    def _run_group(self, args, kwargs, values, elements, device, ranks):
        """One call of the op over the group's elements on the ranks held on ``device``; its result."""
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
        return self.call(*a, **kw)

    @staticmethod
    def _wrapped(layouts: list, runs: list) -> list:
        """A group's results as global tensors, one wrap each: ``runs`` holds each device's
        ``(device, ranks, result list)``, the results rank after rank. A list op's results alias
        nothing (``_foreach_sqrt``, ``_foreach_add.List``): fresh tensors of the caller's mode."""
        m = len(layouts)
        if len(runs) == 1 and len(runs[0][1]) == 1:         # one rank on one device: no dict to build
            device, (r,), out = runs[0]
            return [wrap_fresh(layout, {r: o}, device, o) for layout, o in zip(layouts, out)]
        pieces = [{} for _ in layouts]
        for _, ranks, out in runs:
            for k, r in enumerate(ranks):
                for j in range(m):
                    pieces[j][r] = out[k * m + j]
        device = runs[0][0] if runs else None
        return [wrap_fresh(layout, p, device, next(iter(p.values()))) if p else GlobalTensor(layout, p)
                for layout, p in zip(layouts, pieces)]

    def _element_values(self, s: int, slot, v, values, elements, ranks):
        """The slot's values of the group's elements, rank after rank."""
        if isinstance(v, torch.Tensor):                      # a ``scalars`` tensor: one number per element
            picked = v[list(elements)]
            return torch.cat([picked] * len(ranks)) if len(ranks) > 1 else picked
        if not slot.tensors:
            return [v[i] for _ in ranks for i in elements]
        if s in self.as_given and (len(ranks) == 1 or not slot.written):
            return (list(v) if len(elements) == len(v) else [v[i] for i in elements]) * len(ranks)
        if slot.all_global and not values:
            picked = v if len(elements) == len(v) else [v[i] for i in elements]
            pieces = list(map(_PIECES_OF, picked))
            out = []
            for r in ranks:
                out.extend(map(itemgetter(r), pieces))
            return out
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

    def _held(self) -> None:
        """Per placement: ``[(device, [ranks held here on it])]``, in rank order."""
        world = self._world = get_world()
        self._devices = {}
        placements = {p for p, _ in self.groups} | {lay.placement for lay in (self.out_layouts or {}).values()}
        for placement in placements:
            by_device: Dict[torch.device, list] = {}
            for r in placement.rank_list():
                if world.holds(r):
                    by_device.setdefault(world.device(placement.type, r), []).append(r)
            self._devices[placement] = list(by_device.items())


def install_foreach_support() -> None:
    """``torch.optim`` takes its default foreach path (and ``clip_grad_norm_`` its foreach norm) only
    for tensor types in its ``_foreach_supported_types`` lists: global tensors join them, as
    DTensor does, so an optimizer over global parameters runs the list ops above."""
    for name in ("torch.optim.optimizer", "torch.utils._foreach_utils"):
        types = getattr(importlib.import_module(name), "_foreach_supported_types", None)
        if isinstance(types, list) and GlobalTensor not in types:
            types.append(GlobalTensor)
