"""``__torch_dispatch__`` for global tensors: rule -> signature -> box inputs -> local op -> wrap.

The decision for a call (chosen signature, target layouts of the inputs, output layouts,
how to run it) is cached on the op, the inputs' layouts and the non-tensor arguments, so a
repeated op costs one dictionary look-up before the local ops run. Output meta comes from
running the op on meta tensors of the global shapes, never on full-size data.

Ops without a rule are decomposed into core ATen ops where PyTorch has a decomposition;
only when none applies do they run through the gather-to-broadcast fallback.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch._decomp import decomposition_table
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..boxing import Layout, plan_boxing
from ..comm import get_world
from ..sbp import all_broadcast, as_signature, broadcast, choose, nd_candidates
from ..tensor import GlobalTensor, box, replicate, set_dispatcher
from .fallback import run_fallback
from .foreach import run_foreach
from .registry import find_rule

_local = threading.local()


@dataclass
class Decision:
    """What to do for one cache key: ``run(flat_args, spec)`` gives the op's result."""
    run: Callable


_CACHE: dict = {}
_UNCACHEABLE = object()


def _arg_key(v):
    if isinstance(v, GlobalTensor):
        return v._layout
    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape), v.dtype, v.device.type)
    if isinstance(v, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                      torch.memory_format)):
        return (type(v), v)
    if isinstance(v, (list, tuple)):
        return tuple(_arg_key(x) for x in v)
    return _UNCACHEABLE


def dispatch(func, types, args, kwargs):
    flat, spec = tree_flatten((args, kwargs))
    key = (func, spec, tuple(_arg_key(v) for v in flat))
    decision = None
    try:
        decision = _CACHE.get(key)
        cacheable = True
    except TypeError:
        cacheable = False
    if decision is None:
        decision = _decide(func, flat, spec)
        if cacheable and not any(k is _UNCACHEABLE for k in key[2]):
            _CACHE[key] = decision
    return decision.run(flat, spec)


def _placement_of(func, flat):
    placement, first = None, None
    for i, v in enumerate(flat):
        if isinstance(v, GlobalTensor):
            if placement is None:
                placement, first = v.placement, i
            elif v.placement != placement:
                raise ValueError(f"{func}: all global inputs must share one placement; input {first} is on "
                                 f"{placement} but input {i} is on {v.placement}")
    return placement


def _meta(v):
    if isinstance(v, torch.Tensor):
        return torch.empty(v.shape, dtype=v.dtype, device="meta")
    return v


def _decide(func, flat, spec) -> Decision:
    placement = _placement_of(func, flat)
    tensor_idx = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
    rule = find_rule(func)
    if rule is None and func.overloadpacket.__name__.startswith("_foreach_"):
        return Decision(lambda f, s: run_foreach(func, f, s))
    if rule is None:
        decomposed = _decomposition(func)
        if decomposed is not None:
            return Decision(lambda f, s: _run_decomposition(func, decomposed, f, s))
        return Decision(lambda f, s: run_fallback(func, f, s))
    meta_flat = [_meta(v) for v in flat]
    margs, mkwargs = tree_unflatten(meta_flat, spec)
    try:
        meta_out = func(*margs, **mkwargs)
    except Exception:
        return Decision(lambda f, s: run_fallback(func, f, s))
    out_flat, out_spec = tree_flatten(meta_out)
    out_idx = [i for i, v in enumerate(out_flat) if isinstance(v, torch.Tensor)]
    raw = rule.candidates(*margs, **mkwargs)
    per_axis = [as_signature(c) for c in raw] + [all_broadcast(len(tensor_idx), len(out_idx))]
    per_axis = [c for c in per_axis if len(c.inputs) == len(tensor_idx) and len(c.outputs) == len(out_idx)]
    in_layouts = [flat[i]._layout if isinstance(flat[i], GlobalTensor) else
                  Layout(tuple(flat[i].shape), flat[i].dtype, placement, (broadcast,) * placement.ndim)
                  for i in tensor_idx]
    written = _written_positions(func, flat, spec, tensor_idx)
    candidates = [c for c in nd_candidates([per_axis] * placement.ndim)
                  if all(c.inputs[k] == in_layouts[k].nd_sbp for k in written)]
    if written and not candidates:
        return Decision(lambda f, s: _write_back(func, f, s))

    def cost(c):
        total, steps = 0, 0
        for lay, nd in zip(in_layouts, c.inputs):
            plan = plan_boxing(lay, lay.with_sbp(nd))
            total += plan.bytes
            steps += len(plan.steps)
        return (total, steps)

    out_meta = [(tuple(out_flat[i].shape), out_flat[i].dtype) for i in out_idx]
    if rule.check_shapes:
        candidates = [c for c in candidates if _pieces_line_up(func, c, in_layouts, out_meta, flat, spec,
                                                               tensor_idx, rule, placement)]
    chosen = choose(candidates, cost)
    targets = [lay.with_sbp(nd) for lay, nd in zip(in_layouts, chosen.inputs)]
    out_layouts = [Layout(shape, dtype, placement, nd) for (shape, dtype), nd in zip(out_meta, chosen.outputs)]
    return Decision(_LocalRun(func, tensor_idx, targets, out_flat, out_spec, out_idx, out_layouts, rule.local))


def _written_objects(func, flat, spec) -> list:
    """The tensors an in-place or out= op writes into."""
    schema = func._schema
    args, kwargs = tree_unflatten(flat, spec)
    objs = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = args[i] if i < len(args) else kwargs.get(a.name)
        objs.extend(v if isinstance(v, (list, tuple)) else [v])
    for v in objs:
        if isinstance(v, torch.Tensor) and not isinstance(v, GlobalTensor):
            raise TypeError(f"{func}: cannot write a global result into a plain (local) tensor; "
                            f"make the written tensor global first")
    return objs


def _written_positions(func, flat, spec, tensor_idx) -> list:
    """Positions (among the tensor inputs) of the tensors the op writes: their layout must stay."""
    ids = {id(v) for v in _written_objects(func, flat, spec)}
    return [k for k, i in enumerate(tensor_idx) if id(flat[i]) in ids]


def _functional(func):
    """The out-of-place op of an in-place (``add_``) or out= op, resolved by argument matching."""
    name = func.overloadpacket.__name__
    return getattr(torch.ops.aten, name[:-1] if name.endswith("_") else name)


def _write_back(func, flat, spec):
    """Run the functional op, then box its result into the written tensor's layout and copy it in."""
    args, kwargs = tree_unflatten(flat, spec)
    target = _written_objects(func, flat, spec)[0]
    kwargs = {k: v for k, v in kwargs.items() if k != "out"}
    result = _functional(func)(*args, **kwargs)
    result = box(result if isinstance(result, GlobalTensor) else replicate(result, target.placement),
                 target._layout)
    for r, piece in target._pieces.items():
        piece.copy_(result._pieces[r])
    return target


def _pieces_line_up(func, c, in_layouts, out_meta, flat, spec, tensor_idx, rule, placement) -> bool:
    """Run the local op on meta pieces of every distinct rank shape; outputs must be balanced pieces."""
    targets = [lay.with_sbp(nd) for lay, nd in zip(in_layouts, c.inputs)]
    outs = [Layout(shape, dtype, placement, nd) for (shape, dtype), nd in zip(out_meta, c.outputs)]
    seen = set()
    for r in placement.rank_list():
        shapes = tuple(t.piece_shape(r) for t in targets)
        want = tuple(o.piece_shape(r) for o in outs)
        if (shapes, want) in seen:
            continue
        seen.add((shapes, want))
        local_flat = list(flat)
        for k, i in enumerate(tensor_idx):
            local_flat[i] = torch.empty(shapes[k], dtype=targets[k].dtype, device="meta")
        a, kw = tree_unflatten(local_flat, spec)
        if rule.local is not None:
            a, kw = rule.local(r, targets, outs, *a, **kw)
        try:
            got = [tuple(t.shape) for t in tree_flatten(func(*a, **kw))[0] if isinstance(t, torch.Tensor)]
        except Exception:
            return False
        if tuple(got) != want:
            return False
    return True


class _LocalRun:
    """Box the inputs to the chosen layouts, run the op on each held rank's pieces, wrap the outputs."""

    def __init__(self, func, tensor_idx, targets, out_flat, out_spec, out_idx, out_layouts, local):
        self.func = func
        self.tensor_idx = tensor_idx
        self.targets = targets
        self.out_flat = out_flat
        self.out_spec = out_spec
        self.out_idx = out_idx
        self.out_layouts = out_layouts
        self.local = local
        self.ranks = [r for r in targets[0].placement.rank_list() if get_world().holds(r)] if targets else []

    def __call__(self, flat, spec):
        boxed = list(flat)
        for k, i in enumerate(self.tensor_idx):
            v = flat[i]
            target = self.targets[k]
            if not isinstance(v, GlobalTensor):
                v = replicate(v, target.placement)
            boxed[i] = box(v, target) if v._layout != target else v
        per_rank = {}
        func = self.func
        for r in self.ranks:
            local_flat = list(boxed)
            for i in self.tensor_idx:
                local_flat[i] = boxed[i]._pieces[r]
            a, kw = tree_unflatten(local_flat, spec)
            if self.local is not None:
                a, kw = self.local(r, self.targets, self.out_layouts, *a, **kw)
            per_rank[r] = tree_flatten(func(*a, **kw))[0]
        return self._wrap(per_rank, flat, boxed)

    def _wrap(self, per_rank, flat, boxed):
        out = list(self.out_flat)
        for k, i in enumerate(self.out_idx):
            pieces = {r: outs[i] for r, outs in per_rank.items()}
            written = _reuse_written_input(pieces, flat, boxed, self.tensor_idx)
            out[i] = written if written is not None else GlobalTensor(self.out_layouts[k], pieces)
        for i, v in enumerate(out):
            if not isinstance(v, torch.Tensor) and self.ranks:
                out[i] = per_rank[self.ranks[0]][i]
        return tree_unflatten(out, self.out_spec)


def _reuse_written_input(pieces, flat, boxed, tensor_idx):
    """In-place and out= ops return the global tensor they wrote into."""
    for i in tensor_idx:
        v = flat[i]
        if isinstance(v, GlobalTensor) and boxed[i] is v and pieces and all(
                pieces[r] is v._pieces.get(r) for r in pieces):
            return v
    return None


def _decomposition(func) -> Optional[Callable]:
    fn = decomposition_table.get(func)
    if fn is None:
        return None
    return fn


def _run_decomposition(func, decomposed, flat, spec):
    args, kwargs = tree_unflatten(flat, spec)
    active = getattr(_local, "decomposing", None)
    if active is None:
        active = _local.decomposing = set()
    if func in active:
        return run_fallback(func, flat, spec)
    active.add(func)
    try:
        return decomposed(*args, **kwargs)
    finally:
        active.discard(func)


set_dispatcher(dispatch)
