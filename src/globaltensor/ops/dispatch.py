"""``__torch_dispatch__`` for global tensors: the cache key of a call, the cache, and the call into the
decide stages (ops/decide/: route -> candidates -> cost, a :class:`Decision`) and the executor
(ops/executor/: box inputs -> local op or kernel on each rank's pieces -> wrap).

The decision for a call (chosen signature, target layouts of the inputs, output layouts, how to
run it) is cached on the op, the inputs' layouts, which of them autograd records and the
non-tensor arguments, so a repeated op costs one dictionary look-up before the local ops run.
Output meta comes from the op on meta tensors of the global shapes (schema/out_meta.py), never
on full-size data.

A signature costs the bytes that box its inputs; when autograd records the op, also the
bytes that bring each input's gradient back to the input's layout. Without that, an eager
choice saves in the forward what the backward pays twice: ``sub(P, B)`` would reduce-scatter
its partial input (half an all-reduce), and the gradient, split, would then be all-gathered
once for every matmul of the backward that needs it whole.

In-place ops that change only metadata (``transpose_``, ``squeeze_``) run as their
out-of-place view op, whose layout the tensor takes (writes/inplace_view.py).

Ops without a rule are decomposed into core ATen ops where PyTorch has a decomposition (or a
CompositeImplicitAutograd kernel); only when none applies do they run through the
gather-to-broadcast fallback.
"""
from __future__ import annotations

import operator

import torch

from ..observe import context as attribution
from ..observe.consistency import CHECK as _check
from ..observe.log import log_signature, signatures_logged
from ..tensor import GlobalTensor, set_dispatcher
from .boxed_copy import copy_layout
from .consistency import confirm_op
from .decide import Decision, candidates, choose, cost, decide_list, on_pieces, route, through_twin
from .executor import runner
from .explicit import explicit
from .executor.decompose import decomposed_calls, decomposing  # noqa: F401  (the coverage table reads the calls)
from .interned import intern as _intern
from .registry import on_rules_changed
from .schema.args import SCALARS
from .writes.inplace import has_functional

_CACHE: dict = {}
_UNCACHEABLE = object()
_KEYWORDS = object()             # separates positional from keyword arguments in a key
_grad_enabled = torch.is_grad_enabled


def _recording():
    """Whether autograd records the op: True / False, or "inside" a decomposition of an op it
    records -- whose intermediate tensors require no grad, though the op's backward will need
    its inputs in the layouts the forward chose, so they are costed as recorded."""
    if decomposing.recorded:
        return "inside"
    return _grad_enabled()


def _arg_key(v):
    t = type(v)
    if t is GlobalTensor:
        if v._boxed is not None:
            return (id(v._layout), v.requires_grad, copy_layout(v))
        return (id(v._layout), True) if v.requires_grad else id(v._layout)
    if t in SCALARS:
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
    key = [id(func), "inside" if decomposing.recorded else _grad_enabled(), explicit.depth > 0]
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
    key = [fid, "inside" if decomposing.recorded else _grad_enabled(), explicit.depth > 0]
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
        decision = _looked_up(func, args, kwargs, _key)
    return decision.run(args, kwargs)


def decision_for(func, args, kwargs=None) -> Decision:
    """The Decision ``dispatch`` runs for this call, made (and cached) if it is new; ``decision.run``
    is the executor's runner of it. ``gt.compile``'s capture reads it to label what it records."""
    return _looked_up(func, args, kwargs or {}, _list_key if id(func) in _LIST_OPS else _key)


def _looked_up(func, args, kwargs, key_of) -> Decision:
    """The cached decision of the call, made on a miss: the inputs' layouts are interned first, so
    that equal layouts of other objects give the same key from now on."""
    _intern_inputs(args, kwargs)
    key = key_of(func, args, kwargs)
    decision = _CACHE.get(key)
    if decision is None:
        decision = decide(func, args, kwargs)
        decision.run = runner(decision)
        if decision.route == "list" and key_of is _key:
            _LIST_OPS.add(id(func))            # the decision holds the op: its id is not reused
            key = _list_key(func, args, kwargs)
        if _cacheable(key):
            _CACHE[key] = decision
    return decision


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
                if _PLAIN.issuperset(map(type, v)):      # plain tensors only (step counts), keyed in C
                    return (t, "T", tuple(map(_PLAIN_KEY, v)))
        return (t, tuple([(id(x._layout), x.requires_grad) if type(x) is GlobalTensor else _list_arg_key(x)
                          for x in v]))
    return _arg_key(v)


_LAYOUT_OF = operator.attrgetter("_layout")
_PLAIN = frozenset({torch.Tensor})
_PLAIN_KEY = operator.attrgetter("shape", "dtype", "device", "requires_grad")


def _dispatch_list(func, args, kwargs):
    decision = _CACHE.get(_list_key(func, args, kwargs))
    if decision is None:
        decision = _looked_up(func, args, kwargs, _list_key)
    return decision.run(args, kwargs)


def _intern_inputs(args, kwargs) -> None:
    """Give the global inputs the interned layout objects before their key is stored: a later
    look-up then finds equal layouts by identity, without calling ``Layout.__eq__``."""
    for v in (*args, *kwargs.values()):
        for t in (v if type(v) in (list, tuple) else (v,)):
            if type(t) is GlobalTensor:
                t._layout = _intern(t._layout)


def decide(func, args, kwargs) -> Decision:
    """The decision for this call, through the stages: route, candidates, cost."""
    r = route(func, args, kwargs)
    if r.kind == "list":
        return Decision("list", func, list_kind=r.list_kind,
                        lists=decide_list(func, r.list_kind, args, kwargs, decide))
    if r.kind != "rule":
        return Decision(r.kind, func, decomposition=r.decomposition)
    problem = candidates(r, func, args, kwargs, _recording())
    if not problem.candidates:                 # no signature keeps what the op writes in its layout
        return through_twin(r, problem) if has_functional(func) else Decision("fallback", func)
    chosen = choose(problem, as_they_are=explicit.depth > 0)
    if signatures_logged():
        log_signature(func, problem.in_layouts, chosen, problem.candidates, lambda c: cost(problem, c))
    return on_pieces(r, problem, chosen)


set_dispatcher(dispatch)
on_rules_changed(_CACHE.clear)
