"""Holding every rule to the dispatch cache's key (ops/call_key.py): a number the key takes by its type
only must not change the decision.

While :func:`value_free_keys_checked` is open, every decision the dispatcher makes is made again with
each such number changed (to zero and to nonzeros, of the same type; a rule's ``keyed=`` argument only
to values its function classes alike) and must come out the same: the same route, the same candidate
signatures offered by the op's rule (a layout the sweep does not try would choose among them), and
for a call on the pieces the same signature, input targets, output layouts, writes and view base. A rule whose
candidates read such a number without declaring ``keyed=`` -- masked_fill's zero fill, sdpa's
dropout, a zero pad -- makes a finding. A changed number that makes the op itself invalid (torch's
meta kernel raises: ``cdist`` with ``p < 0``) is no call anyone makes, and is passed over.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List

import torch
from torch.utils._pytree import tree_map

from globaltensor.ops import dispatch, rng
from globaltensor.ops.call_key import key_spec
from globaltensor.ops.decide import candidates, route
from globaltensor.ops.schema.op_record import record

#: the values a number is changed to: zero, a positive and a negative (the classes a rule may read)
_OTHERS = {float: (0.0, 0.375, -2.5), int: (0, 3, -2), complex: (0j, 1 + 2j), bool: (False, True)}


def _variants(func, args: tuple, kwargs: dict) -> Iterator[tuple]:
    """``(argument name, its value, another value, args, kwargs)`` for each number the key leaves out --
    given, or left at its schema default -- changed to the other value (a default one passed by name)."""
    spec = key_spec(func)
    by_type, by_type_names, classified, listed = spec.by_type, spec.by_type_names, spec.classified, spec.listed
    if listed:
        return
    rec = record(func)
    classes = {index: fn for index, fn in classified}
    places = [(i, v, i) for i, v in enumerate(args) if i in by_type]
    places += [(k, v, rec.by_name[k].index) for k, v in kwargs.items() if k in by_type_names]
    places += [(a.name, a.default, a.index) for a in rec.args
               if a.name in by_type_names and a.index >= len(args) and a.name not in kwargs
               and type(a.default) in _OTHERS]
    for where, v, index in places:
        if type(v) not in _OTHERS:
            continue
        fn = classes.get(index)
        for other in _OTHERS[type(v)]:
            if other == v or (fn is not None and fn(other) != fn(v)):
                continue
            if isinstance(where, int):
                yield rec.args[where].name, v, other, args[:where] + (other,) + args[where + 1:], kwargs
            else:
                yield where, v, other, args, {**kwargs, where: other}


def _meta_accepts(func, args: tuple, kwargs: dict) -> bool:
    """Whether torch's meta kernel takes the call (tensors as meta tensors of their shapes)."""
    as_meta = (lambda v: torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v)
    try:
        func(*tree_map(as_meta, args), **tree_map(as_meta, kwargs))
    except Exception:                   # noqa: BLE001 -- any refusal of the op's own
        return False
    return True


def _offered(func, args: tuple, kwargs: dict):
    """The candidate signatures the op's rule offers for the call (None for a route without a rule)."""
    r = route(func, args, kwargs)
    return candidates(r, func, args, kwargs, dispatch._recording()).candidates if r.kind == "rule" else None


def _same(a, b) -> bool:
    """Whether two decisions are the same (the candidates offered are compared apart)."""
    if a.route != b.route:
        return False
    if a.route == "local":
        return (a.signature, a.targets, a.out_layouts, a.written, a.returned, a.view_base) == \
            (b.signature, b.targets, b.out_layouts, b.written, b.returned, b.view_base)
    if a.route == "list":
        return (a.lists.targets, a.lists.groups, a.lists.solo, a.lists.out_layouts) == \
            (b.lists.targets, b.lists.groups, b.lists.solo, b.lists.out_layouts)
    return True


def _describe(d) -> str:
    return f"{d.route} {d.signature}" if d.route == "local" else d.route


@contextlib.contextmanager
def value_free_keys_checked() -> Iterator[List[str]]:
    """Within, each decision is checked as the module docstring says; yields the list of findings."""
    findings: List[str] = []
    real = dispatch.decide

    def decide(func, args, kwargs):
        made = real(func, args, kwargs)
        first = None                    # what the rule offers for the call as made, once
        for name, given, other, a, kw in _variants(func, args, kwargs):
            if not _meta_accepts(func, a, kw):
                continue
            offset = rng.current_offset()
            try:
                again = real(func, a, kw)
                first = _offered(func, args, kwargs) if first is None else first
                offered = first, _offered(func, a, kw)
            except Exception:           # noqa: BLE001 -- the changed number is invalid for the op
                continue
            finally:
                rng.set_offset(offset)
            if not _same(made, again) or offered[0] != offered[1]:
                findings.append(f"{func}: {name}={other!r} instead of {given!r} decides {_describe(again)}, not "
                                f"{_describe(made)}" + ("" if offered[0] == offered[1] else
                                                        f" (the rule offers {len(offered[1] or ())} candidates, not "
                                                        f"{len(offered[0] or ())})") +
                                "; the rule reads a number the cache key leaves out: declare it with "
                                "register_rule(keyed=...)")
        return made

    dispatch.decide = decide
    dispatch.dispatch_cache_clear()         # every call decides, so every call is checked
    try:
        yield findings
    finally:
        dispatch.decide = real
