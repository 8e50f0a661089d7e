"""The dispatch cache's key of a call: what can change the op's decision, and nothing that only scales
or fills.

A decision (route, signature, boxing targets, output layouts) depends on the inputs' layouts, on
whether autograd records the op, and on the arguments that shape the work -- a dim, a size, a
dtype, a flag. It does not depend on the value of a number that scales or fills: an ``alpha``, a
``value=``, an optimizer's step size, a scalar operand (``x * 0.5``). Such a number enters the key
by its type only (an int and a float promote differently), so a training loop whose scalars change
at every step hits the same entry.

Which arguments are such numbers comes from the op's schema (:func:`key_spec`): a Python number
given where the schema takes a ``Scalar``, a ``float``, a ``complex`` or a ``Tensor`` (a wrapped
number) enters by type; ``int``, ``int[]``, ``bool``, a dtype, a string -- everything else -- by
value. A rule whose candidates read one of those numbers says so (``register_rule(keyed=)``): a
function of the value gives what enters the key (``masked_fill`` keeps a partial sum only for a
zero fill: ``keyed={"value": is_zero}``). The OpInfo sweep (tests/conformance/test_opinfo.py, with
tests/key_check.py) holds every rule to this: a rule that reads a number the key leaves out fails there.

In the backward, the running autograd node's gradient sinks enter the key too
(gradient_sinks.py): an output that joins a partial sum anyway may stay partial there.

A list op (``_foreach_*``, the fused optimizers) keys each number by type and a list of numbers
by its length; its tensors by their layouts, as a single op's.

The global inputs' layouts enter by ``id``: interned layouts (boxing/interned.py) live as long as the
process, so an id stands for one layout; op overloads live as long, and enter by id too.
"""
from __future__ import annotations

import operator
from typing import NamedTuple, Optional

import torch

from ..tensor import GlobalTensor
from .kept_boxed_copy import copy_layout
from .decide.lists import list_kind
from .executor.decompose import decomposing
from .explicit import explicit
from .gradient_sinks import current_sinks
from .registry import find_rule, on_rules_changed
from .schema.args import SCALARS
from .schema.op_record import record

UNCACHEABLE = object()           # an argument the key cannot hold: the call is decided every time
_KEYWORDS = object()             # separates positional from keyword arguments in a key
_NUMBERS = frozenset({int, float, complex, bool})
#: schema types where a Python number given is a factor or a fill (``Scalar`` prints as ``number``)
_VALUE_FREE = frozenset({"number", "Optional[number]", "float", "Optional[float]", "complex", "Optional[complex]",
                         "Tensor", "Optional[Tensor]"})
#: schema types that take a Python number (the others, lists and strings and dtypes, never do)
_NUMERIC = _VALUE_FREE | {"int", "Optional[int]", "bool", "Optional[bool]"}     # (a SymInt prints as int)
_grad_enabled = torch.is_grad_enabled


class KeySpec(NamedTuple):
    """How one op's arguments enter its key."""
    fid: int                     # id of the op
    by_type: frozenset           # positions whose numbers enter by type
    by_type_names: frozenset     # the same arguments' names, given by keyword
    classified: tuple            # (schema index, function): the rule's ``keyed=`` arguments
    listed: bool                 # a list op (``_foreach_*``, fused optimizers, unscale)
    mixed: bool                  # some positions take a number by type, others by value: ask each one's
    all_typed: bool              # every position that takes a number takes it by type (add, mul, mm, relu)


_SPECS: dict = {}


def key_spec(func) -> KeySpec:
    """The key spec of ``func``, from its schema and its rule's ``keyed=``; made on first use."""
    spec = _SPECS.get(id(func))
    if spec is None:
        spec = _SPECS[id(func)] = _make_spec(func)
    return spec


def _make_spec(func) -> KeySpec:
    rec = record(func)
    rule = find_rule(func)
    keyed = dict(rule.keyed or {}) if rule is not None else {}     # names checked at registration
    free = [a for a in rec.args if a.type in _VALUE_FREE or a.name in keyed]
    classified = tuple((rec.by_name[name], fn if fn is not None else _itself) for name, fn in keyed.items())
    positional = frozenset(a.index for a in free if not a.kwarg_only)
    numeric = {a.index for a in rec.args if not a.kwarg_only and a.type in _NUMERIC}
    return KeySpec(id(func), positional, frozenset(a.name for a in free), tuple((a.index, fn) for a, fn in classified),
                   rule is None and list_kind(func) is not None, bool(positional) and not numeric <= positional,
                   numeric <= positional)


def grad_state():
    """How autograd stands to the call: "inside" a decomposition of an op it records, True where it
    records the op, else the running backward node's gradient sinks (gradient_sinks.py: False for none)."""
    if decomposing.recorded:
        return "inside"
    return _grad_enabled() or current_sinks()


def _itself(v):
    return v


def arg_key(v):
    """How an argument enters a key by value: a global tensor by its layout, whether it requires
    grad and its kept copy's layout (ops/kept_boxed_copy.py); a plain tensor by its meta; a number or
    other plain value as it is; a list element by element; anything else makes the call uncacheable."""
    t = type(v)
    if t is GlobalTensor:
        if v._boxed is not None:
            return (id(v._layout), v.requires_grad, copy_layout(v))
        return (id(v._layout), True) if v.requires_grad else id(v._layout)
    if t in SCALARS:
        return (t, v)
    if t is list or t is tuple:
        return (t, tuple(map(arg_key, v)))
    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape), v.dtype, v.device.type, v.requires_grad)
    return UNCACHEABLE


def call_key(func, args: tuple, kwargs: Optional[dict]) -> tuple:
    """The cache key of ``func(*args, **kwargs)`` -- the one key function, for the look-up of every
    call and the store of a new decision alike. A call of global tensors only (``add(a, b)``, ``mm``,
    ``relu``: the hot path) needs nothing of the op's spec; at the first other argument, or keywords,
    the key is made from it (:func:`_spec_key`). A call takes one of the two ways every time, so its
    look-up and its store agree."""
    key = [id(func), grad_state(), explicit.depth > 0]
    for v in args:
        if type(v) is GlobalTensor and v._boxed is None:
            key.append((id(v._layout), True) if v.requires_grad else id(v._layout))
        else:
            return _spec_key(func, args, kwargs)
    if kwargs:
        return _spec_key(func, args, kwargs)
    return tuple(key)


def _spec_key(func, args: tuple, kwargs: Optional[dict]) -> tuple:
    """The key of a call with a number, a list, a plain tensor or keywords: from the op's spec."""
    fid, by_type, by_type_names, classified, listed, mixed, all_typed = key_spec(func)
    if listed:
        return _list_key(fid, args, kwargs)
    key = [fid, grad_state(), explicit.depth > 0]
    if mixed:
        i = 0
        for v in args:
            t = type(v)
            if t is GlobalTensor and v._boxed is None:
                key.append((id(v._layout), True) if v.requires_grad else id(v._layout))
            elif t in _NUMBERS and i in by_type:
                key.append(t)
            else:
                key.append(arg_key(v))
            i += 1
    else:                       # every number by type, or every number by value: no position to ask
        for v in args:
            t = type(v)
            if t is GlobalTensor and v._boxed is None:
                key.append((id(v._layout), True) if v.requires_grad else id(v._layout))
            elif all_typed and t in _NUMBERS:
                key.append(t)
            else:
                key.append(arg_key(v))
    if kwargs:
        key.append(_KEYWORDS)
        for k, v in kwargs.items():
            t = type(v)
            key.append((k, t) if t in _NUMBERS and k in by_type_names else (k, arg_key(v)))
    if classified:
        key.append(_classes(func, classified, args, kwargs or {}))
    return tuple(key)


def _classes(func, classified: tuple, args: tuple, kwargs: dict) -> tuple:
    """What the rule's ``keyed=`` functions make of their arguments (their defaults where not given)."""
    rec = record(func)
    out = []
    for index, fn in classified:
        a = rec.args[index]
        given = index < len(args) and not a.kwarg_only
        v = args[index] if given else kwargs.get(a.name, a.default)
        out.append(fn(v))
    return tuple(out)


def cacheable(key) -> bool:
    if key is UNCACHEABLE:
        return False
    if type(key) is tuple:
        return all(cacheable(k) for k in key)
    return True


# -- list ops ---------------------------------------------------------------------------------

def _list_key(fid: int, args: tuple, kwargs: Optional[dict]) -> tuple:
    """A list op's key: its tensors' layouts, its numbers by type only. Learning rates, betas and
    the bias corrections in a ``ScalarList`` change every step, and a list op's decision (its
    elements' signatures) does not depend on their values."""
    key = [fid, grad_state(), explicit.depth > 0]
    key.extend(map(_list_arg_key, args))
    if kwargs:
        key.append(_KEYWORDS)
        key.extend((k, _list_arg_key(v)) for k, v in kwargs.items())
    return tuple(key)


def _list_arg_key(v):
    t = type(v)
    if t is float or t is int:
        return t
    if t is list or t is tuple:
        if v and type(v[0]) in (float, int):          # a ScalarList: its length only
            return (t, float, len(v))
        if not _grad_enabled():
            try:        # a list of global tensors, keyed in C: with grad off requires_grad decides nothing
                return (t, tuple(map(id, map(_LAYOUT_OF, v))))
            except AttributeError:
                if _PLAIN.issuperset(map(type, v)):      # plain tensors only (step counts), keyed in C
                    return (t, "T", tuple(map(_PLAIN_KEY, v)))
        return (t, tuple([(id(x._layout), x.requires_grad) if type(x) is GlobalTensor else _list_arg_key(x)
                          for x in v]))
    return arg_key(v)


_LAYOUT_OF = operator.attrgetter("_layout")
_PLAIN = frozenset({torch.Tensor})
_PLAIN_KEY = operator.attrgetter("shape", "dtype", "device", "requires_grad")

on_rules_changed(_SPECS.clear)
