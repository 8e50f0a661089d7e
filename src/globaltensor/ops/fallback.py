"""The fallback for ops without a rule: gather every input to broadcast, run on each replica.

Correct for any op (data-dependent output shapes included) at the price of the gathers;
warns once per op so the missing rule is visible. ``taken`` counts the calls per op, so a
caller (the conformance suite) can tell whether a computation went through it.
"""
from __future__ import annotations

import warnings
from collections import Counter

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..boxing import Layout
from ..comm import get_world
from ..sbp import broadcast
from ..tensor import GlobalTensor, box, replicate
from .registry import find_rule
from .viewwrite import fallback_view, propagate

_warned: set = set()
taken: Counter = Counter()


def _warn_once(func) -> None:
    if func not in _warned:
        _warned.add(func)
        if find_rule(func) is None:
            why, hint = "has no SBP rule", "register one with gt.register_rule"
        else:   # a rule that cannot plan this call: an output shape that depends on the data, say
            why, hint = "has an SBP rule that cannot plan this call", "e.g. its output shape depends on the data"
        warnings.warn(f"globaltensor: {func} {why}; its inputs are gathered to broadcast "
                      f"and it runs on every replica ({hint})", stacklevel=4)


def reject_other_layouts(func, values, what: str = "input") -> None:
    """A global tensor's pieces are strided: a sparse (or other non-strided) tensor meeting global
    tensors, or coming out of an op on their pieces, raises naming the op."""
    for v in values:
        if isinstance(v, torch.Tensor) and not isinstance(v, GlobalTensor) and v.layout != torch.strided:
            hint = "convert it with .to_dense() first" if what == "input" else "keep such results local"
            raise TypeError(f"globaltensor: {func}: a {v.layout} tensor {what}; global tensors hold strided "
                            f"pieces only (sparse and other layouts are not supported): {hint}")


def run_fallback(func, flat, spec):
    taken[func] += 1
    reject_other_layouts(func, flat)
    placement = next(v.placement for v in flat if isinstance(v, GlobalTensor))
    b = (broadcast,) * placement.ndim
    gathered = list(flat)
    for i, v in enumerate(flat):
        if isinstance(v, GlobalTensor):
            gathered[i] = box(v, v._layout.with_sbp(b))
        elif isinstance(v, torch.Tensor):
            gathered[i] = replicate(v, placement)
    world = get_world()
    ranks = [r for r in placement.rank_list() if world.holds(r)]
    per_rank = {}
    for r in ranks:
        local = [v._pieces[r] if isinstance(v, GlobalTensor) else v for v in gathered]
        a, kw = tree_unflatten(local, spec)
        per_rank[r] = tree_flatten(func(*a, **kw))
    if not ranks:
        raise RuntimeError(f"{func}: this process holds no rank of {placement}, so it cannot run the op "
                           f"(it has no rule; ranks outside a placement skip only ops with rules)")
    out_flat, out_spec = per_rank[ranks[0]]
    reject_other_layouts(func, out_flat, "as its result")
    _warn_once(func)       # after the op ran: an op invalid for its shapes raises torch's error, unwarned
    result = []
    for j, v in enumerate(out_flat):
        if isinstance(v, torch.Tensor):
            pieces = {r: per_rank[r][0][j] for r in ranks}
            written = _write_into_input(func, flat, gathered, pieces)
            result.append(written if written is not None else
                          GlobalTensor(Layout(tuple(v.shape), v.dtype, placement, b), pieces))
        else:
            result.append(v)
    out = tree_unflatten(result, out_spec)
    fallback_view(func, *tree_unflatten(flat, spec), out)
    return out


def _write_into_input(func, flat, gathered, pieces):
    """An in-place op ran on gathered copies: write its result back into the original input."""
    for orig, g in zip(flat, gathered):
        if isinstance(orig, GlobalTensor) and all(pieces[r] is g._pieces.get(r) for r in pieces):
            if any(g._pieces[r] is not orig._pieces.get(r) for r in pieces):
                result = box(GlobalTensor(g._layout, pieces), orig._layout)
                for r, piece in orig._pieces.items():
                    piece.copy_(result._pieces[r])
            propagate(orig)
            return orig
    return None
