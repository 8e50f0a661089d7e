"""``__torch_dispatch__`` for global tensors: the cache of decisions, and the call into the decide
stages (ops/decide/: route -> candidates -> cost, a :class:`Decision`) and the executor
(ops/executor/: box inputs -> local op or kernel on each rank's pieces -> wrap).

The decision for a call (chosen signature, target layouts of the inputs, output layouts, how to
run it) is cached under the call's key (call_key.py: the op, the inputs' layouts, which of them
autograd records and the non-tensor arguments that can change the decision -- not a number that
only scales or fills), so a repeated op costs one dictionary look-up before the local ops run. The
cache is bounded, least recently used out first (decision_cache.py). Output meta comes from the op
on meta tensors of the global shapes (schema/out_meta.py), never on full-size data.

A signature costs the bytes that box its inputs; when autograd records the op, also the
bytes that bring each input's gradient back to the input's layout. Without that, an eager
choice saves in the forward what the backward pays twice: ``sub(P, B)`` would reduce-scatter
its partial input (half an all-reduce), and the gradient, split, would then be all-gathered
once for every matmul of the backward that needs it whole.

In-place ops that change only metadata (``transpose_``, ``squeeze_``) run as their
out-of-place view op, whose layout the tensor takes (writes/metadata_ops.py).

Ops without a rule are decomposed into core ATen ops where PyTorch has a decomposition (or a
CompositeImplicitAutograd kernel); only when none applies do they run through the
gather-to-broadcast fallback.
"""
from __future__ import annotations

import torch

from ..observe import context as attribution
from ..observe.consistency import CHECK as _check
from ..observe.log import log_signature, signatures_logged
from ..tensor import GlobalTensor, set_dispatcher
from .call_key import cacheable, call_key
from .op_description import confirm_op
from .decide import Decision, candidates, choose, cost, decide_list, on_pieces, route, through_twin
from .decision_cache import CacheInfo, DecisionCache
from .executor import runner
from .explicit import explicit
from .executor.decompose import decomposed_calls, decomposing  # noqa: F401  (the coverage table reads the calls)
from ..boxing.interned import intern as _intern
from .registry import on_rules_changed
from .writes.written_inputs import has_functional

CACHE = DecisionCache()
_recent = CACHE.recent
_hits = 0                               # the hot path's hits (CACHE counts those of its own look-ups)
_grad_enabled = torch.is_grad_enabled


def _recording():
    """Whether autograd records the op: True / False, or "inside" a decomposition of an op it
    records -- whose intermediate tensors require no grad, though the op's backward will need
    its inputs in the layouts the forward chose, so they are costed as recorded."""
    if decomposing.recorded:
        return "inside"
    return _grad_enabled()


def dispatch(cls, func, types, args=(), kwargs=None):
    global _hits
    if attribution.on and attribution.entering_op():      # a comm_profile is open, or boxings are logged
        return attribution.within_op(dispatch, cls, func, types, args, kwargs)
    if _check.enabled:
        confirm_op(func, args, kwargs)
    if kwargs is None:
        kwargs = {}
    decision = _recent.get(call_key(func, args, kwargs))
    if decision is None:
        decision = _looked_up(func, args, kwargs)
    else:
        _hits += 1
    return decision.run(args, kwargs)


def decision_for(func, args, kwargs=None) -> Decision:
    """The Decision ``dispatch`` runs for this call, made (and cached) if it is new; ``decision.run``
    is the executor's runner of it. ``gt.compile``'s capture reads it to label what it records."""
    return _looked_up(func, args, kwargs or {})


def _looked_up(func, args, kwargs) -> Decision:
    """The cached decision of the call, made on a miss: the inputs' layouts are interned first, so
    that equal layouts of other objects give the same key from now on."""
    _intern_inputs(args, kwargs)
    key = call_key(func, args, kwargs)
    decision = CACHE.get(key)
    if decision is None:
        CACHE.misses += 1
        decision = decide(func, args, kwargs)
        decision.run = runner(decision)
        if cacheable(key):
            CACHE.store(key, decision)
    return decision


def dispatch_cache_info() -> CacheInfo:
    """The dispatch cache's hits, misses, size and maxsize (as ``functools.lru_cache``'s
    ``cache_info``): a steady training loop shows a flat size and no new misses."""
    return CACHE.info(_hits)


def dispatch_cache_clear() -> None:
    """Drop every cached decision and zero the counts (the next call of each op decides again)."""
    global _hits
    CACHE.clear()
    _hits = 0


def set_dispatch_cache_size(maxsize: int) -> None:
    """Keep at most ``maxsize`` decisions (default decision_cache.MAXSIZE), least recently used out first."""
    CACHE.resize(maxsize)


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
    if r.kind == "align":
        return Decision("align", func, placement_to=r.placement)
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
on_rules_changed(CACHE.drop_all)
