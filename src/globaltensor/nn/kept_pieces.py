"""An elementwise optimizer's lists kept as pieces between steps: each step takes only the new gradients'.

Between two steps an optimizer's parameters and their states are the same tensors holding the same
pieces; only the gradients are new. Yet the lists reused by nn/optim_groups.py hold global tensors,
and the update's call (nn/optim_pieces.py) reads each one's layout and pieces again at every step:
some ten passes over the wrappers' attributes -- 40-70 us for the GPT's 53 parameters, where plain
torch's fused AdamW step at n_embd 32 takes 200 us (benchmarks/optimizer.py).

So after a step has made its lists of global tensors, :class:`KeptPieces` turns them into the lists
the update's call would take -- each list over the (element, rank) order of nn/pieces_shape.py, a
placeholder where no rank of an element is held here, each extra held rank's copy of a plain step
count -- and keeps the parameters' and states' pieces and the step counts' copies (:class:`_KeptCopies`).
The next step checks by identity that the parameters hold the same pieces dicts, that their states
hold the same tensors and that no compiled call rebound a piece (``tensor.piece_rebinds``); then it
hands torch's step the kept lists with the gradients' pieces taken now, and the update sees plain
tensors only.

Only where torch's step passes its lists to the update and reads them nowhere else: an optimizer of
exactly a ``torch.optim`` elementwise class (a subclass's step is its own code), not SGD (its step
writes each momentum buffer back into the state by its parameter). And only while the update would
run eagerly on pieces: not while ``gt.compile`` captures (the update is one task of the graph, on its
global lists), nor where GradScaler's ``grad_scale`` / ``found_inf`` on the optimizer or one of the
group's settings is a global tensor (the update would take it beside plain lists). GradScaler's own
are plain: a fused update takes them and unscales the gradients' pieces, as on the pieces path.

What is kept: the parameters' and states' pieces, which the optimizer holds anyway. A state or a
parameter replaced (``load_state_dict``, a module's ``to``) is let go at the next step, or at once by
``load_state_dict`` (optim_groups.py forgets the optimizer's lists there); a gradient is never kept.
"""
from __future__ import annotations

import operator
from itertools import chain, compress
from typing import Optional

import torch

from ..tensor import GlobalTensor, piece_rebinds
from .pieces_shape import (copies_of, dim_of, layout_of, order_of, pieces_of, placeholders_of,
                           states_over_order, with_placeholders)

_PIECES = operator.attrgetter("_pieces")
_VERSION = operator.attrgetter("_version")
_GLOBAL = {GlobalTensor}
_PLAIN = {torch.Tensor}
#: the kinds of list (:class:`KeptPieces`): none given, the gradients, kept pieces, plain step counts
EMPTY, GRADS, KEPT, STEPS = range(4)


class KeptPieces:
    """One group's lists as pieces (module docstring). ``held``: the parameters the lists are over;
    ``states``: their state dicts (their tensors, in order, are checked at each step); ``kinds`` /
    ``kept``: each list's kind and what is kept of it."""

    def __init__(self, held: list, states: list, kinds: list, kept: list, order: list, ranks: Optional[list],
                 placeholders: list):
        self.pieces = list(map(_PIECES, held))
        self.values = list(chain.from_iterable(map(dict.values, states)))
        self.kinds, self.kept, self.order, self.ranks, self.placeholders = kinds, kept, order, ranks, placeholders
        elements, copies = copies_of(order, len(held))
        self.counts = [_KeptCopies(own, elements, copies) if kind == STEPS else None for kind, own in zip(kinds, kept)]
        self.rebinds = piece_rebinds()

    @staticmethod
    def of(held: list, layouts: tuple, given: list, states: list, lists: tuple) -> Optional["KeptPieces"]:
        """The kept lists of a step's global ``lists`` over ``held`` (in ``layouts``, with the gradients
        ``given``, the states ``states``); None where a list is not one of the kinds the update's call takes, or holds
        a tensor whose layout is not its parameter's very object (the update's call on global lists
        gives an equal one the parameter's, nn/optim_pieces.py: the next step keeps them)."""
        n = len(held)
        order, ranks = order_of(held, layouts)
        placeholders = placeholders_of(held, order)
        kinds, kept = [], []
        for made in lists:
            if not made:
                kinds.append(EMPTY)
                kept.append(None)
                continue
            if len(made) != n:
                return None
            types = set(map(type, made))
            if all(map(operator.is_, made, given)):
                kinds.append(GRADS)
                kept.append(None)
            elif types == _GLOBAL and all(map(operator.is_, map(layout_of, made), layouts)):
                kinds.append(KEPT)
                kept.append(with_placeholders(pieces_of(made, order, ranks), placeholders))
            elif types == _PLAIN and not any(map(dim_of, made)):
                kinds.append(STEPS)
                kept.append(list(made))
            else:
                return None
        return KeptPieces(held, states, kinds, kept, order, ranks, placeholders)

    def fill(self, held: list, given: list, states: list, lists: tuple) -> bool:
        """Fill the empty ``lists`` with the kept pieces and the gradients' pieces, if nothing kept was
        replaced; else False. (optim_groups.py has checked the parameters, the gradients' layouts and the
        states' entry counts.)"""
        if piece_rebinds() != self.rebinds or not all(map(operator.is_, map(_PIECES, held), self.pieces)) \
                or not all(map(operator.is_, chain.from_iterable(map(dict.values, states)), self.values)):
            return False
        self._extend(lists, given)
        return True

    def into(self, lists: tuple, given: list) -> None:
        """Replace the global ``lists`` this was made of by their pieces (at the step that made them)."""
        for made in lists:
            made.clear()
        self._extend(lists, given)

    def _extend(self, lists: tuple, given: list) -> None:
        for made, kind, kept, counts in zip(lists, self.kinds, self.kept, self.counts):
            if kind == KEPT:
                made.extend(kept)
            elif kind == GRADS:
                made.extend(with_placeholders(pieces_of(given, self.order, self.ranks), self.placeholders))
            elif kind == STEPS:
                made.extend(counts.now())


class _KeptCopies:
    """A list of plain step counts over the order, each extra held rank's copy kept between steps (it
    is the update's alone). The update changes an element's count and its copies alike, so their
    version counters move together; where a count's counter moved on its own -- a write outside the
    update (``state["step"].fill_(0)``), or a step that updated fresh copies (nn/optim_pieces.py, on
    global lists) -- the copies are made anew from it. Cloning every copy at every step costs more than
    the rest of the lists (4 simulated ranks: 159 clones, 140 us for the GPT's 53 parameters)."""

    def __init__(self, own: list, elements: Optional[list], copies: Optional[list]):
        self.own, self.elements, self.copies = own, elements, copies
        self._make()

    def _make(self) -> None:
        self.over = states_over_order(self.own, self.elements, self.copies)
        if self.elements is None:           # one position per element: no copies
            self.sources = self.made = self.gaps = []
            return
        self.sources = [self.own[i] for i, copy in zip(self.elements, self.copies) if copy]
        self.made = list(compress(self.over, self.copies))
        # an inference tensor has no version counter: its copies are made at every step
        self.gaps = None if any(map(torch.Tensor.is_inference, self.sources)) else self._gaps()

    def _gaps(self) -> list:
        return list(map(operator.sub, map(_VERSION, self.sources), map(_VERSION, self.made)))

    def now(self) -> list:
        """The list over the order, its copies in step with their counts."""
        if self.gaps is None or self._gaps() != self.gaps:
            self._make()
        return self.over

