"""``__torch_dispatch__`` for global tensors: rule -> signature -> box inputs -> local op -> wrap.

The decision for a call (chosen signature, target layouts of the inputs, output layouts,
how to run it) is cached on the op, the inputs' layouts, which of them autograd records and
the non-tensor arguments, so a repeated op costs one dictionary look-up before the local ops
run. Output meta comes from the op on meta tensors of the global shapes (out_meta.py), never
on full-size data.

A signature costs the bytes that box its inputs; when autograd records the op, also the
bytes that bring each input's gradient back to the input's layout. Without that, an eager
choice saves in the forward what the backward pays twice: ``sub(P, B)`` would reduce-scatter
its partial input (half an all-reduce), and the gradient, split, would then be all-gathered
once for every matmul of the backward that needs it whole.

In-place ops that change only metadata (``transpose_``, ``squeeze_``) run as their
out-of-place view op, whose layout the tensor takes (inplace_view.py).

Ops without a rule are decomposed into core ATen ops where PyTorch has a decomposition (or a
CompositeImplicitAutograd kernel); only when none applies do they run through the
gather-to-broadcast fallback.
"""
from __future__ import annotations

import operator
import threading
from collections import Counter
from typing import Callable, Optional

import torch
from torch._decomp import decomposition_table
from torch.utils._pytree import tree_flatten

from ..boxing import Layout, plan_boxing
from ..comm import profile_context as attribution
from ..comm.profile_log import log_signature, signatures_logged
from ..comm.consistency import CHECK as _check
from ..sbp import Signature, Split, all_broadcast, as_signature, broadcast, choose, nd_candidates
from ..sbp.shape import blocks_problem
from ..tensor import GlobalTensor, gradient_layout, set_dispatcher
from .args import Substitution, get, tensor_positions
from .boxed_copy import copy_layout
from .consistency import confirm_op
from .fallback import reject_other_layouts, run_fallback
from .list_ops import ListRun, decide_list_op, list_kind
from .interned import intern as _intern
from .inplace import has_functional, returned_inputs, write_back, written_objects
from .inplace_view import is_inplace_view, run_inplace_view
from .local_run import LocalRun
from .out_meta import output_meta
from .registry import find_rule, on_rules_changed
from .scalar_read import SCALAR_READS, read_scalar
from .signature_cost import contracting_axes, gradient_under, output_cost
from .viewwrite import WriteRun as _WriteRun, wrap as _views_and_writes
from .written_args import check_writes_kept

_CACHE: dict = {}
_UNCACHEABLE = object()
_KEYWORDS = object()             # separates positional from keyword arguments in a key
_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_grad_enabled = torch.is_grad_enabled


class _Decomposing(threading.local):
    ops: set = None            # the ops whose decompositions are running
    recorded: int = 0          # how many of them autograd records


_decomposing = _Decomposing()
decomposed_calls: Counter = Counter()   # calls per op that ran as its decomposition (the coverage table reads it)


def _recording():
    """Whether autograd records the op: True / False, or "inside" a decomposition of an op it
    records -- whose intermediate tensors require no grad, though the op's backward will need
    its inputs in the layouts the forward chose, so they are costed as recorded."""
    if _decomposing.recorded:
        return "inside"
    return _grad_enabled()


def _arg_key(v):
    t = type(v)
    if t is GlobalTensor:
        if v._boxed is not None:
            return (id(v._layout), v.requires_grad, copy_layout(v))
        return (id(v._layout), True) if v.requires_grad else id(v._layout)
    if t in _SCALARS:
        return (t, v)
    if t is list or t is tuple:
        return (t, tuple(map(_arg_key, v)))
    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape), v.dtype, v.device.type, v.requires_grad)
    return _UNCACHEABLE


def _cacheable(key) -> bool:
    if key is _UNCACHEABLE:
        return False
    if type(key) is tuple:
        return all(_cacheable(k) for k in key)
    return True


def _key(func, args, kwargs, arg_key=None) -> tuple:
    """The cache key of a call. The op and the global inputs' layouts enter by ``id``: both hash
    in Python, and ids are cheap. A layout's id stands for the layout only once it is interned
    (interned layouts live as long as the process); keys are stored only then. The cached
    decision holds the op, so its id is not reused while the entry lives. ``arg_key``: how an
    argument enters (:func:`_arg_key`; a list op's, :func:`_list_arg_key`)."""
    arg_key = arg_key or _arg_key
    key = [id(func), "inside" if _decomposing.recorded else _grad_enabled()]
    key.extend(map(arg_key, args))
    if kwargs:
        key.append(_KEYWORDS)
        key.extend((k, arg_key(v)) for k, v in kwargs.items())
    return tuple(key)


def dispatch(cls, func, types, args=(), kwargs=None):
    if attribution.on and attribution.entering_op():      # a comm_profile is open, or boxings are logged
        return attribution.within_op(dispatch, cls, func, types, args, kwargs)
    if _check.enabled:
        confirm_op(func, args, kwargs)
    fid = id(func)
    if fid in _LIST_OPS:
        return _dispatch_list(func, args, kwargs or {})
    # the hit path is ``_key`` inlined for global tensors without a kept copy, one look-up
    key = [fid, "inside" if _decomposing.recorded else _grad_enabled()]
    for v in args:
        if type(v) is GlobalTensor and v._boxed is None:
            key.append((id(v._layout), True) if v.requires_grad else id(v._layout))
        else:
            key.append(_arg_key(v))
    if kwargs:
        key.append(_KEYWORDS)
        key.extend((k, _arg_key(v)) for k, v in kwargs.items())
    else:
        kwargs = {}
    decision = _CACHE.get(tuple(key))
    if decision is None:
        _intern_inputs(args, kwargs)            # equal layouts of other objects: the same key now
        key = _key(func, args, kwargs)
        decision = _CACHE.get(key)
        if decision is None:
            decision = _decide(func, args, kwargs)
            if isinstance(decision, ListRun):
                _LIST_OPS.add(id(func))            # the decision holds the op: its id is not reused
                key = _list_key(func, args, kwargs)
            if _cacheable(key):
                _CACHE[key] = decision
    return decision(args, kwargs)


_LIST_OPS: set = set()          # ids of the list ops met so far: keyed without their numbers


def _list_key(func, args, kwargs) -> tuple:
    """The cache key of a list op: its tensors' layouts, its numbers by type only. Learning rates,
    betas and the bias corrections in a ``ScalarList`` change every step, and a list op's decision
    (its elements' signatures) does not depend on their values."""
    return _key(func, args, kwargs, _list_arg_key)


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
                pass
        return (t, tuple([(id(x._layout), x.requires_grad) if type(x) is GlobalTensor else _list_arg_key(x)
                          for x in v]))
    return _arg_key(v)


_LAYOUT_OF = operator.attrgetter("_layout")


def _dispatch_list(func, args, kwargs):
    key = _list_key(func, args, kwargs)
    decision = _CACHE.get(key)
    if decision is None:
        _intern_inputs(args, kwargs)
        key = _list_key(func, args, kwargs)
        decision = _CACHE.get(key)
        if decision is None:
            decision = _decide(func, args, kwargs)
            if _cacheable(key):
                _CACHE[key] = decision
    return decision(args, kwargs)


def _intern_inputs(args, kwargs) -> None:
    """Give the global inputs the interned layout objects before their key is stored: a later
    look-up then finds equal layouts by identity, without calling ``Layout.__eq__``."""
    for v in (*args, *kwargs.values()):
        for t in (v if type(v) in (list, tuple) else (v,)):
            if type(t) is GlobalTensor:
                t._layout = _intern(t._layout)


def _flat(run: Callable) -> Callable:
    """Adapt a runner of (func, flat leaves, spec) to the (args, kwargs) calling convention."""
    return lambda args, kwargs: run(*tree_flatten((args, kwargs)))


def _placement_of(func, tensors):
    placement, first = None, None
    for i, v in enumerate(tensors):
        if isinstance(v, GlobalTensor):
            if placement is None:
                placement, first = v.placement, i
            elif v.placement != placement:
                raise ValueError(f"{func}: all global inputs must share one placement; tensor input {first} is on "
                                 f"{placement} but tensor input {i} is on {v.placement}")
    return placement


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _out_kind(meta_out) -> str:
    if isinstance(meta_out, torch.Tensor):
        return "tensor"
    if meta_out is None:
        return "none"
    if isinstance(meta_out, (tuple, list)) and all(isinstance(t, (torch.Tensor, int)) or t is None for t in meta_out):
        return "tuple" if isinstance(meta_out, tuple) else "list"     # ints: flash attention's max_q / max_k
    return "other"


def _decide(func, args, kwargs, only=None) -> Callable:
    """How to run ``func`` on these arguments. ``only`` (tests) restricts the choice to one
    nd-signature; None comes back when it is not admissible for these arguments."""
    decision = _decision(func, args, kwargs, only)
    if isinstance(decision, LocalRun):
        return _views_and_writes(func, decision.fast(), decision.positions, decision.targets, decision.kept)
    return decision


def _decision(func, args, kwargs, only=None):
    """A LocalRun where the op runs as itself (or its rule's kernel) on each rank's pieces, else
    the callable that runs it (a list op, an in-place view, a decomposition, the fallback)."""
    if is_inplace_view(func):
        return lambda a, k: run_inplace_view(func, a, k)
    if func in SCALAR_READS:
        return read_scalar
    check_writes_kept(func)
    rule = find_rule(func)
    kind = list_kind(func) if rule is None else None
    if kind is not None:
        return decide_list_op(func, kind, args, kwargs, _decision)
    if rule is None:
        decomposed = decomposition_table.get(func) or _composite(func)
        if decomposed is not None:
            return lambda a, k: _run_decomposition(func, decomposed, a, k)
        return _flat(lambda f, s: run_fallback(func, f, s))
    positions = tensor_positions(args, kwargs)
    if positions is None:
        return _flat(lambda f, s: run_fallback(func, f, s))
    tensors = [get(args, kwargs, p) for p in positions]
    reject_other_layouts(func, tensors)
    meta_args, meta_kwargs = Substitution(positions)(args, kwargs, [_meta(t) for t in tensors])
    try:
        meta_out = output_meta(func, meta_args, meta_kwargs)
    except Exception:
        return _flat(lambda f, s: run_fallback(func, f, s))
    kind = _out_kind(meta_out)
    if kind == "other":
        return _flat(lambda f, s: run_fallback(func, f, s))
    placement = _placement_of(func, tensors)
    if rule.out_meta is not None:
        meta_out = rule.out_meta(meta_out, placement.type, *meta_args, **meta_kwargs)
    outs = [meta_out] if kind == "tensor" else [o for o in meta_out if isinstance(o, torch.Tensor)] \
        if kind != "none" else []
    in_layouts = [t._layout if isinstance(t, GlobalTensor) else
                  Layout(tuple(t.shape), t.dtype, placement, (broadcast,) * placement.ndim) for t in tensors]
    per_axis = [as_signature(c) for c in rule.candidates(*meta_args, **meta_kwargs)]
    per_axis += _blocked_variants(rule, per_axis, in_layouts, meta_args, meta_kwargs)
    per_axis = [c for c in per_axis + [all_broadcast(len(tensors), len(outs))]
                if len(c.inputs) == len(tensors) and len(c.outputs) == len(outs)]
    inside = _recording() == "inside"
    recorded = [inside or (_grad_enabled() and t.requires_grad) for t in tensors]
    kept_copies = [copy_layout(t) if type(t) is GlobalTensor else None for t in tensors]
    written = {id(v) for v in written_objects(func, args, kwargs)}
    kept = [k for k, t in enumerate(tensors) if id(t) in written]
    returned = returned_inputs(func, args, kwargs, tensors)
    # a written tensor keeps its layout, as an input and as the output that returns it
    candidates = [c for c in nd_candidates([per_axis] * placement.ndim)
                  if all(c.inputs[k] == in_layouts[k].nd_sbp for k in kept)
                  and all(c.outputs[j] == in_layouts[k].nd_sbp for j, k in returned.items() if j < len(c.outputs))]
    if kept and not candidates:
        if not has_functional(func):
            return _flat(lambda f, s: run_fallback(func, f, s))
        return _WriteRun(lambda a, k: write_back(func, a, k), [positions[k] for k in kept])
    out_meta = [(tuple(o.shape), o.dtype) for o in outs]
    candidates = [c for c in candidates if _blocks_fit(c, in_layouts, out_meta, placement)]
    if rule.check_shapes:
        candidates = [c for c in candidates
                      if _pieces_line_up(func, c, in_layouts, out_meta, args, kwargs, positions, rule, placement)]
    if only is not None:
        candidates = [c for c in candidates if c == only]
        if not candidates:
            return None

    def cost(c):
        """Bytes to box the inputs; making an input partial also costs the reduction it defers,
        and an input autograd records costs the way back of its gradient."""
        total, steps = 0, 0
        contracted = contracting_axes(c)
        for lay, nd, grad, kept in zip(in_layouts, c.inputs, recorded, kept_copies):
            target = lay.with_sbp(nd)
            plans = [plan_boxing(lay, target)]
            if kept is not None:                       # a kept boxed copy may be the cheaper start
                plans = [min(plans[0], plan_boxing(kept, target), key=lambda p: p.bytes)]
            if any(v.is_partial and not u.is_partial and a not in contracted
                   for a, (u, v) in enumerate(zip(lay.nd_sbp, nd))):
                plans.append(plan_boxing(target, lay))     # not where the output's reduction sums it too
            if grad:
                plans.append(plan_boxing(gradient_under(target, c), gradient_layout(lay)))
            total += sum(p.bytes for p in plans)
            steps += sum(len(p.steps) for p in plans)
        later = output_cost(in_layouts, c, out_templates)
        return (total + later[0], steps + later[1])

    out_templates = [Layout(shape, dtype, placement, (broadcast,) * placement.ndim) for shape, dtype in out_meta]

    # a candidate taking the inputs as they are costs nothing: no need to plan the others
    exact = [c for c in candidates if all(nd == lay.nd_sbp for lay, nd in zip(in_layouts, c.inputs))
             and output_cost(in_layouts, c, out_templates) == (0, 0)]
    chosen = choose(exact, lambda c: (0, 0)) if exact else choose(candidates, cost)
    if signatures_logged():
        log_signature(func, in_layouts, chosen, candidates, cost)
    targets = [_intern(lay.with_sbp(nd)) for lay, nd in zip(in_layouts, chosen.inputs)]
    out_layouts = [_intern(Layout(shape, dtype, placement, nd)) for (shape, dtype), nd in zip(out_meta, chosen.outputs)]
    return LocalRun(func, positions, targets, kind, out_layouts, rule.local, returned, rule.kernel,
                    [isinstance(o, torch.Tensor) for o in meta_out] if kind in ("tuple", "list") else None, kept)


def _blocked_variants(rule, per_axis, in_layouts, meta_args, meta_kwargs) -> list:
    """The candidates of a ``blocked`` rule again with every split blocked, once per block
    count the inputs' blocked splits have."""
    counts = sorted({v.blocks for lay in in_layouts for v in lay.nd_sbp if v.is_split and v.blocks > 1})
    return blocked_variants(rule, per_axis, counts, meta_args, meta_kwargs) if counts else []


def blocked_variants(rule, per_axis, counts, meta_args, meta_kwargs) -> list:
    """``per_axis`` (or the part ``rule.blocked`` names) with every split blocked ``f`` ways, for each
    ``f`` in ``counts``; nothing for a rule that is not ``blocked``."""
    if not rule.blocked:
        return []
    eligible = per_axis if rule.blocked is True else [as_signature(c) for c in rule.blocked(*meta_args, **meta_kwargs)]
    blocked = lambda vs, f: tuple(Split(v.dim, f) if v.is_split else v for v in vs)
    plain = [c for c in eligible if any(v.is_split for v in c.inputs + c.outputs)
             and not any(v.is_split and v.blocks > 1 for v in c.inputs + c.outputs)]
    return [Signature(blocked(c.inputs, f), blocked(c.outputs, f)) for f in counts for c in plain]


def _blocks_fit(c, in_layouts, out_meta, placement) -> bool:
    """Whether every blocked split of the nd-candidate lays out its tensor (sbp/shape.py)."""
    hierarchy = placement.hierarchy
    return not any(blocks_problem(shape, hierarchy, nd)
                   for shape, nd in [(lay.shape, nd) for lay, nd in zip(in_layouts, c.inputs)] +
                   [(shape, nd) for (shape, _), nd in zip(out_meta, c.outputs)]
                   if any(v.is_split and v.blocks > 1 for v in nd))


def _pieces_line_up(func, c, in_layouts, out_meta, args, kwargs, positions, rule, placement) -> bool:
    """Run the local op on meta pieces of every distinct rank shape; outputs must be balanced pieces."""
    substitute = Substitution(positions)
    targets = [lay.with_sbp(nd) for lay, nd in zip(in_layouts, c.inputs)]
    outs = [Layout(shape, dtype, placement, nd) for (shape, dtype), nd in zip(out_meta, c.outputs)]
    seen = set()
    for r in placement.rank_list():
        shapes = tuple(t.piece_shape(r) for t in targets)
        want = tuple(o.piece_shape(r) for o in outs)
        if (shapes, want) in seen:
            continue
        seen.add((shapes, want))
        a, kw = substitute(args, kwargs, [torch.empty(s, dtype=t.dtype, device="meta")
                                          for s, t in zip(shapes, targets)])
        if rule.local is not None:
            a, kw = rule.local(r, targets, outs, *a, **kw)
        try:
            got = [tuple(t.shape) for t in tree_flatten(func(*a, **kw))[0] if isinstance(t, torch.Tensor)]
        except Exception:
            return False
        if tuple(got) != want:
            return False
    return True


def _composite(func) -> Optional[Callable]:
    """The op's CompositeImplicitAutograd kernel, which calls other ops, when it has one.

    Such ops (``log_sigmoid``, ``narrow``, ``flatten``, ``matmul``, ``__or__``, ...) are normally
    taken apart above autograd and never reach a tensor subclass; they do reach it from inside a
    Python decomposition, which runs below autograd (``binary_cross_entropy_with_logits``,
    ``glu``, the backward of ``hardtanh``)."""
    if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
        return func.decompose
    return None


def _run_decomposition(func, decomposed, args, kwargs):
    """Dispatch the op's core-ATen decomposition; an op met again inside its own one falls back."""
    active = _decomposing.ops
    if active is None:
        active = _decomposing.ops = set()
    if func in active:
        return run_fallback(func, *tree_flatten((args, kwargs)))
    decomposed_calls[func] += 1
    recorded = int(_grad_enabled() and any(isinstance(v, torch.Tensor) and v.requires_grad
                                           for v in tree_flatten((args, kwargs))[0]))
    active.add(func)
    _decomposing.recorded += recorded
    try:
        return decomposed(*args, **kwargs)
    finally:
        active.discard(func)
        _decomposing.recorded -= recorded


set_dispatcher(dispatch)
on_rules_changed(_CACHE.clear)
