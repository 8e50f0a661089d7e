"""The fallback for ops without a rule: gather every input to broadcast, run on each replica.

Correct for any op (data-dependent output shapes included) at the price of the gathers;
warns once per op so the missing rule is visible. The op writes into the gathered copies, so
every argument its schema marks written, returned or not, is written back: a global tensor
boxed from the written copy into its own layout (a split one takes its slice, a partial one
the value on its first rank and zeros elsewhere), a plain one from the first rank's copy. ``taken`` counts the calls per op;
``gt.fallback_calls()`` reports them, so a program (and the conformance suite) can tell whether a
computation went through it.
"""
from __future__ import annotations

import warnings
from collections import Counter
from typing import Dict

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..boxing import Layout
from ..comm import get_world
from ..sbp import broadcast
from ..tensor import GlobalTensor, box, replicate, write_into
from .explicit import refuse_fallback
from .schema.op_record import record
from .registry import find_rule
from .writes.copy_views import fallback_view, propagate

_warned: set = set()
taken: Counter = Counter()


def fallback_calls() -> Dict[str, int]:
    """``{op name: calls}``: the ops that ran through the gather fallback in this process, since its
    start or :func:`fallback_calls_clear`, most called first."""
    return {str(func): n for func, n in taken.most_common()}


def fallback_calls_clear() -> None:
    """Start :func:`fallback_calls` over."""
    taken.clear()


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
    refuse_fallback(func, [v._layout for v in flat if isinstance(v, GlobalTensor)])
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
    args, kwargs = tree_unflatten(flat, spec)
    if torch.Tag.nondeterministic_seeded in func.tags:
        _one_draw(func, args, kwargs, flat, gathered, per_rank, placement, world)
    _write_back(func, args, kwargs, flat, gathered, ranks[0])
    result = []
    for j, v in enumerate(out_flat):
        if isinstance(v, torch.Tensor):
            pieces = {r: per_rank[r][0][j] for r in ranks}
            written = _written_input(flat, gathered, pieces)
            result.append(written if written is not None else
                          GlobalTensor(Layout(tuple(v.shape), v.dtype, placement, b), pieces))
        else:
            result.append(v)
    out = tree_unflatten(result, out_spec)
    fallback_view(func, args, kwargs, out)
    return out


def _one_draw(func, args, kwargs, flat, gathered, per_rank: dict, placement, world) -> None:
    """A random op ran on every replica, each drawing its own numbers: every rank takes the draws of
    the placement's first rank -- its results and what it wrote -- by one broadcast of each, so the
    replicas of the (broadcast) result are equal."""
    group = tuple(placement.rank_list())
    src = group[0]
    copy_of = {id(v): g for v, g in zip(flat, gathered) if isinstance(g, GlobalTensor)}
    written = [copy_of[id(v)] for v in record(func).written_tensors(args, kwargs) if id(v) in copy_of]
    slots = [{r: out[0][j] for r, out in per_rank.items()} for j, v in enumerate(per_rank[next(iter(per_rank))][0])
             if isinstance(v, torch.Tensor)]
    slots += [dict(g._pieces) for g in written]
    seen = set()
    for pieces in slots:
        first = next(iter(pieces.values()))
        if id(first) in seen:                   # an output that is a written argument: drawn once
            continue
        seen.add(id(first))
        drawn = world.broadcast(group, src, {src: pieces[src]} if src in pieces else {}, tuple(first.shape),
                                first.dtype, placement.type)
        with torch.no_grad():
            for r, piece in pieces.items():
                if r != src:
                    piece.copy_(drawn[r])


def _write_back(func, args, kwargs, flat, gathered, first: int) -> None:
    """Every argument the op wrote -- returned or not (a fused optimizer's ``grads``, ``found_inf``) --
    gets the written copy back: a global tensor in its own layout, a plain one from the first rank."""
    copy_of = {id(v): g for v, g in zip(flat, gathered) if isinstance(v, torch.Tensor)}
    with torch.no_grad():
        for v in record(func).written_tensors(args, kwargs):
            g = copy_of.get(id(v))
            if g is None:
                continue
            if isinstance(v, GlobalTensor):
                write_into(v, g)
                propagate(v)
            elif g._pieces[first] is not v:
                v.copy_(g._pieces[first])


def _written_input(flat, gathered, pieces):
    """The caller's input whose gathered copy the op returned (an in-place op): already written back."""
    for orig, g in zip(flat, gathered):
        if isinstance(orig, GlobalTensor) and all(pieces[r] is g._pieces.get(r) for r in pieces):
            return orig
    return None
