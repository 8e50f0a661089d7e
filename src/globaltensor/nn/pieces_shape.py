"""The shape of an update's call on pieces (nn/optim_pieces.py): what follows from its arguments' kinds
and layouts, not from their values.

An optimizer's steps pass its functional update the same lists, in the same layouts, step after step;
the gradients are new tensors and the numbers (a scheduled learning rate) change. So the shape is made
at the first call: which arguments are lists of global tensors and which of plain step counts, which
are other tensors and which are settings; the order of (element, rank) positions; the placeholders
and copies the order needs. At each later call :meth:`CallShape.fits` checks it in a few passes in C:
the same arguments given, each setting of the same type, the same list arguments as long as then,
every element's layout the same interned object (a plain tensor has none), the step counts 0-dim.
The shape holds no tensor; each call reads its tensors anew.
"""
from __future__ import annotations

import operator
from typing import Callable, Optional

import torch

from ..tensor import GlobalTensor

#: an element's layout, a tensor's dimension count: for passes in C (``map``)
layout_of = operator.attrgetter("_layout")
_PIECES = operator.attrgetter("_pieces")
_PLACEMENT = operator.attrgetter("placement")
dim_of = operator.attrgetter("ndim")
_GLOBAL = {GlobalTensor}
#: how many shapes are kept (one per optimizer group, in practice); the oldest goes first
KEPT = 64


class CallShape:
    """One call's shape (module docstring). ``lists``: the list arguments, parameters and gradients
    first; ``plain``: those of 0-dim plain states; ``holes``: list -> the elements it holds None for
    (Adafactor's states); ``order`` / ``ranks``: see :func:`order_of`; ``layouts``: the parameters'."""

    def __init__(self, fn: Callable, bound: dict, lists: list, plain: set, holes: dict, order: list,
                 ranks: Optional[list], layouts: list, columns: dict):
        params = bound["params"]
        self.fn, self.lists, self.plain, self.holes, self.order, self.ranks = fn, lists, plain, holes, order, ranks
        self.layouts, self.n, self.grads = tuple(layouts), len(params), lists[1]
        self.fused = bool(bound.get("fused"))
        self.held = list(params[0]._pieces)       # the ranks this process holds (the world's, in effect)
        self.kinds = {k: set(map(type, bound[k])) for k in plain}
        self.names = frozenset(bound)             # the arguments given
        self.others = [k for k in bound if k not in columns]
        self.other_kinds = tuple(type(bound[k]) for k in self.others)
        self.empty = [k for k in self.others if type(bound[k]) is list]
        self.tensor_args = [k for k in self.others if isinstance(bound[k], torch.Tensor)]
        self.setting_names = [k for k in self.others if k not in self.tensor_args]
        self.placeholders = placeholders_of(params, order)
        self.counts = {k: len(columns[k]) for k in lists if k not in plain}     # pieces per global list
        self.plain_order, self.copies = copies_of(order, self.n)

    def fits(self, bound: dict) -> bool:
        """Whether a later call's arguments have this shape (the module docstring's checks)."""
        if self.holes or bound.keys() != self.names or bool(bound.get("fused")) != self.fused \
                or tuple(map(type, map(bound.get, self.others))) != self.other_kinds \
                or any(map(bound.get, self.empty)) or list(bound["params"][0]._pieces) != self.held:
            return False
        for k in self.lists:
            values = bound.get(k)
            if type(values) is not list or len(values) != self.n:
                return False
            if k in self.plain:
                if set(map(type, values)) != self.kinds[k] or set(map(dim_of, values)) != {0}:
                    return False
                continue
            try:            # a layout identical to the parameter's: a global tensor (a plain one has none)
                if not all(map(operator.is_, map(layout_of, values), self.layouts)):
                    return False
            except AttributeError:
                return False
        return True

    def columns(self, bound: dict) -> dict:
        """Each list argument's tensors for the call: a global list's pieces over the order, a plain list as given."""
        return {k: list(bound[k]) if k in self.plain else pieces_of(bound[k], self.order, self.ranks)
                for k in self.lists}


class Shapes:
    """The shapes of the latest calls, by update and by the parameters' count and first layout."""

    def __init__(self):
        self.kept: dict = {}

    @staticmethod
    def key(fn: Callable, whole: bool, params: list) -> tuple:
        return fn, whole, len(params), id(params[0]._layout)

    def get(self, key: tuple) -> Optional[CallShape]:
        return self.kept.get(key)

    def keep(self, key: tuple, shape: CallShape) -> None:
        if shape.holes:
            return
        self.kept.pop(key, None)
        if len(self.kept) >= KEPT:
            del self.kept[next(iter(self.kept))]
        self.kept[key] = shape


def order_of(params: list, layouts: list) -> tuple:
    """``[(element, rank)]``: each parameter at each rank this process holds of it (see PiecesCall); and
    where every parameter shares one placement, the ranks (outermost in the order), else None."""
    if len(set(map(id, map(_PLACEMENT, layouts)))) == 1:
        ranks = list(params[0]._pieces) or [None]
        return [(i, r) for r in ranks for i in range(len(params))], ranks
    return [(i, r) for i, p in enumerate(params) for r in (list(p._pieces) or [None])], None


def pieces_of(values: list, order: list, ranks: Optional[list]) -> list:
    """The pieces of a global list over the order (placeholders left out): with ``ranks`` outermost,
    one pass in C per rank."""
    if ranks is None:
        return [values[i]._pieces[r] for i, r in order if r is not None]
    out = []
    for r in ranks:
        if r is not None:
            out.extend(map(operator.itemgetter(r), map(_PIECES, values)))
    return out


def placeholders_of(params: list, order: list) -> list:
    """``[(position, dtype, device)]``: the positions of the order where no rank of the element is held
    here, each to take an empty tensor of its parameter's dtype and device."""
    return [(j, params[i].dtype, params[i].device) for j, (i, r) in enumerate(order) if r is None]


def with_placeholders(pieces: list, placeholders: list) -> list:
    """``pieces`` (a global list's, placeholders left out) with an empty tensor at each placeholder's position."""
    for j, dtype, device in placeholders:
        pieces.insert(j, torch.empty(0, dtype=dtype, device=device))
    return pieces


def copies_of(order: list, n: int) -> tuple:
    """``(elements, copies)``: a plain list's state at each position of the order is its element's own (at
    the element's first position) or a copy made for the call. With one position per element (``n``),
    ``(None, None)``: the list as given."""
    if len(order) == n:
        return None, None
    seen: set = set()
    copies = []
    for i, _ in order:
        copies.append(i in seen)
        seen.add(i)
    return [i for i, _ in order], copies


def states_over_order(own: list, elements: Optional[list], copies: Optional[list]) -> list:
    """A plain list's states over the order (:func:`copies_of`), the copies made now."""
    if elements is None:
        return own
    return [own[i].clone() if copy else own[i] for i, copy in zip(elements, copies)]
