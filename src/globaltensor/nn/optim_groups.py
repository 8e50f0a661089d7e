"""An optimizer's lists for a step over global parameters, remade by torch's loop only when what they
are made of changed.

At every step torch's optimizers build the lists their functional update takes (``_init_group``:
the parameters that have a gradient, the gradients, each state's tensors) in a Python loop over the
group's parameters. The loop reads each parameter's ``.grad`` (three times; on a global tensor a Python
property, which reduces a partial gradient once it is read), ``torch.is_complex`` and its state.
Over global parameters this loop costs 1.6x what it costs over plain ones, and it is most of what an
elementwise step over global parameters costs above plain torch where a step is launch-bound
(benchmarks/optimizer.py: n_embd 32, and a GPU's step at small sizes).

The lists follow from the group's parameters, which have a gradient, the gradients' layouts, the
parameters' states (keys and tensors) and the group settings the loop reads. So the first call is
torch's own, watched (:class:`_WatchedGroup` records the settings it reads). Then each element of
each list is found among the parameters, the gradients and the states' values, or is None: its
position (:class:`_Made`). The next call checks, in a few passes in C, that the group holds the same
parameters, that the same ones have gradients and that each gradient is in its parameter's layout
(the ``.grad`` property would return it as it is), that each state has the same keys (where the lists
are kept as pieces, the same tensors in the same order: :meth:`_Made.fill`), and that the settings
read are as they were (:data:`TYPE_ONLY`). Then it takes the lists from the current
gradients and states by those positions, and returns what the loop returned. Otherwise the loop runs
again, watched. Examples: a partial gradient to reduce, a state made or replaced, a changed
setting, a parameter added.

An optimizer of a class whose step passes its lists to its update only (:data:`ON_PIECES`: torch's
elementwise ones but SGD) takes them as pieces while the update would run eagerly on pieces: the
lists the update's call takes, kept between steps with only the new gradients' pieces taken at each
(nn/kept_pieces.py). Else nothing is held but the parameters (the optimizer holds them too): each
call reads the gradients and the states anew. Either way a gradient freed by ``zero_grad`` stays
freed, and no list carries a stale tensor; ``load_state_dict`` forgets an optimizer's lists.

Only an optimizer whose ``state`` is torch's own ``defaultdict`` is watched: a mapping of its own (a
``ZeroOptimizer``'s inner optimizer reads its parameters' states by their shards) may find a state
that ``state.get`` would not.
"""
from __future__ import annotations

import operator
import weakref
from collections import defaultdict
from itertools import chain, repeat
from typing import Callable, Optional

import torch

from ..compat.dynamo import inlined_wrapper
from ..tensor import GlobalTensor, _grad_slot
from . import mapped_call
from .kept_pieces import KeptPieces
from .pieces_shape import layout_of

#: group settings a loop reads for their kind only: ``lr`` -- Adam's loop refuses a tensor ``lr`` with
#: ``foreach`` and no ``capturable``; Rprop's and ASGD's read its number only to make a state, and the
#: lists are reused only where every state was made already
TYPE_ONLY = frozenset({"lr"})

_grad_of = _grad_slot.__get__
_SUBCLASS_FUNCTION_OFF = torch._C.DisableTorchFunctionSubclass
_NO_STATE: dict = {}                   # a parameter without a state: read, never written
_GLOBAL = {GlobalTensor}


class _WatchedGroup(dict):
    """A copy of a parameter group that records which settings are read (writes reach the group)."""

    def __init__(self, group: dict):
        super().__init__(group)
        self.group, self.read = group, []

    def __getitem__(self, key):
        self.read.append(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.append(key)
        return super().get(key, default)

    def __setitem__(self, key, value):
        self.group[key] = value
        super().__setitem__(key, value)


def _same_setting(key, now, then) -> bool:
    if isinstance(then, torch.Tensor):
        return now is then
    return type(now) is type(then) and (key in TYPE_ONLY or now == then)


class _Made:
    """What one watched call made a group's lists of, and from where each element came."""

    def __init__(self, group: dict, params: tuple, took: Optional[list], layouts: tuple, lens: list,
                 keys: list, settings: tuple, positions: list, returned):
        self.group, self.params, self.took, self.layouts = group, params, took, layouts
        have = set(took or ())
        self.present = None if took is None else [i in have for i in range(len(params))]
        self.lens, self.keys, self.settings, self.positions, self.returned = lens, keys, settings, positions, returned
        self.kept: Optional[KeptPieces] = None

    @staticmethod
    def of(opt, group: dict, lists: tuple, read: list, returned) -> Optional["_Made"]:
        """The positions of the lists a watched call made; None where an element came from elsewhere
        or one object sits in two places (the positions would be ambiguous)."""
        params = tuple(group["params"])
        grads = list(map(_grad_of, params))
        took = [i for i, g in enumerate(grads) if g is not None]
        held = [params[i] for i in took]
        given = [grads[i] for i in took]
        if set(map(type, held)) | set(map(type, given)) != _GLOBAL:
            return None
        layouts = tuple(map(layout_of, held))
        if not all(map(operator.is_, map(layout_of, given), layouts)):
            return None
        states = list(map(opt.state.get, held, repeat(_NO_STATE)))
        flat = [*params, *grads, *chain.from_iterable(map(dict.values, states))]
        where: dict = {}
        for i, v in enumerate(flat):
            if v is not None:
                if id(v) in where:
                    return None
                where[id(v)] = i
        none_at = len(flat)
        positions = []
        for made in lists:
            at = [none_at if v is None else where.get(id(v), -1) for v in made]
            if -1 in at:
                return None
            positions.append(at)
        settings = tuple((k, group[k]) for k in dict.fromkeys(read) if k != "params" and k in group)
        return _Made(group, params, None if len(took) == len(params) else took, layouts,
                     list(map(len, states)), list(chain.from_iterable(states)), settings, positions, returned)

    def _in_layouts(self, held: list, given: list) -> bool:
        """Every parameter and gradient in the layout object the parameter had (a plain tensor has none)."""
        try:
            return all(map(operator.is_, map(layout_of, given), self.layouts)) \
                and all(map(operator.is_, map(layout_of, held), self.layouts))
        except AttributeError:
            return False

    def fill(self, opt, group: dict, lists: tuple, on_pieces: bool) -> bool:
        """Fill ``lists`` as the loop would, if nothing it reads changed (else False, ``lists`` left
        empty): of global tensors, or where ``on_pieces``, of their pieces (nn/kept_pieces.py).

        The kept pieces need no look at the states' keys: their tensors, checked by identity and in
        order, are what the lists hold. (Only a state rebuilt with a key renamed, its tensors in the
        same order, goes unseen there; torch's loop, reading the states by key, would fail on it.) The
        keys cost more than the rest of the check: a step of the GPT's fused AdamW on one simulated rank
        took 1.06-1.11x plain torch's with them, 1.00-1.04x without (benchmarks/optimizer.py's steps,
        interleaved)."""
        params = group["params"]
        if len(params) != len(self.params) or not all(map(operator.is_, params, self.params)):
            return False
        with _SUBCLASS_FUNCTION_OFF():       # the slot read skips looking up each one's __torch_function__
            grads = list(map(_grad_of, params))
        if self.took is None:
            held, given = params, grads
        else:
            if list(map(operator.is_not, grads, repeat(None))) != self.present:
                return False
            held = list(map(params.__getitem__, self.took))
            given = list(map(grads.__getitem__, self.took))
        if not self._in_layouts(held, given):
            # as torch's loop would, first: read through the .grad property, which gives a gradient in
            # an equal layout its parameter's interned layout object and reduces a partial one
            grads = [None if g is None else p.grad for p, g in zip(params, grads)]
            given = grads if self.took is None else list(map(grads.__getitem__, self.took))
            if not self._in_layouts(held, given):
                return False
        states = list(map(opt.state.get, held, repeat(_NO_STATE)))
        if list(map(len, states)) != self.lens:
            return False
        if not all(_same_setting(k, group.get(k), v) for k, v in self.settings):
            return False
        if on_pieces and self.kept is not None and self.kept.fill(held, given, states, lists):
            return True
        if list(chain.from_iterable(states)) != self.keys:
            return False
        flat = [*params, *grads, *chain.from_iterable(map(dict.values, states)), None]
        for made, at in zip(lists, self.positions):
            made.extend(map(flat.__getitem__, at))
        if on_pieces:
            self.kept = KeptPieces.of(held, self.layouts, given, states, lists)
            if self.kept is not None:
                self.kept.into(lists, given)
        return True


#: optimizer -> {id(group): _Made}
_made: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _lists(init_group: Callable, opt, group: dict, lists: tuple, on_pieces: bool):
    """``init_group(opt, group, *lists)``'s result and lists: reused (:meth:`_Made.fill`; where
    ``on_pieces`` and the update would run eagerly, as pieces) or made, watched."""
    made = _made.get(opt)
    entry = None if made is None else made.get(id(group))
    if entry is not None and entry.group is group and not any(lists):
        if entry.fill(opt, group, lists, on_pieces and _eager_update(opt, group)):
            return entry.returned
        entry.kept = None               # let go of the pieces kept before the loop makes new states
    params = group["params"]
    if not params or type(params[0]) is not GlobalTensor or group.get("differentiable") \
            or type(opt.state) is not defaultdict or not all(type(v) is list and not v for v in lists):
        return init_group(opt, group, *lists)
    watched = _WatchedGroup(group)
    returned = init_group(opt, watched, *lists)
    entry = _Made.of(opt, group, lists, watched.read, returned)
    if made is None:
        made = _made[opt] = {}
        opt.register_load_state_dict_pre_hook(_forget)
    live = {id(g) for g in opt.param_groups}
    for stale in [k for k in made if k not in live]:
        del made[stale]
    if entry is None:
        made.pop(id(group), None)
    else:
        made[id(group)] = entry
    return returned


def _forget(opt, state_dict) -> None:
    """``load_state_dict``'s pre-hook: the optimizer's lists are made anew, and the pieces kept of its
    states let go before the new states are made."""
    _made[opt].clear()


def _eager_update(opt, group: dict) -> bool:
    """Whether the update would run now on pieces with nothing global beside its lists: no capture
    records it (``gt.compile``), and neither GradScaler's tensors on the optimizer nor the group's
    settings are global."""
    return mapped_call._capture is None and type(getattr(opt, "grad_scale", None)) is not GlobalTensor \
        and type(getattr(opt, "found_inf", None)) is not GlobalTensor and _GLOBAL.isdisjoint(map(type, group.values()))


#: the classes whose step passes its lists to its update only, which runs on pieces (nn/optim_pieces.py
#: adds them): an optimizer of exactly one of them -- a subclass's step is its own code -- takes its
#: lists as pieces (nn/kept_pieces.py)
ON_PIECES: set = set()

#: the wrapper's code (:func:`reused_lists`)
_WRAPPER = """
def _init_group(self, group, *lists):
    if is_compiling():
        return fn(self, group, *lists)
    return made_lists(fn, self, group, lists, type(self) in on_pieces)
"""


def reused_lists(cls: type) -> None:
    """Wrap ``cls._init_group`` (once): over global parameters, its lists reused while nothing they are
    made of changed; over plain ones, and while Dynamo traces, torch's own."""
    fn = cls.__dict__["_init_group"]
    if hasattr(fn, "torch_init_group"):
        return
    namespace = {"fn": fn, "made_lists": _lists, "is_compiling": torch.compiler.is_compiling,
                 "on_pieces": ON_PIECES}
    wrapper = inlined_wrapper(_WRAPPER, "_init_group", namespace, f"{cls.__name__}._init_group, reused")
    wrapper.__doc__, wrapper.torch_init_group = fn.__doc__, fn
    cls._init_group = wrapper
