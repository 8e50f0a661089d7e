"""The elementwise optimizers of ``torch.optim`` step on the pieces: plain tensors, no ``__torch_dispatch__``.

Adam, AdamW, SGD, Adagrad, Adadelta, Adamax, ASGD, NAdam, RAdam, RMSprop and Rprop update each element
of a parameter from the same element of its gradient and states, with numbers (the learning rate, a
step count's bias correction) shared by all elements. A parameter, its gradient and each state tensor
hold one layout, so each rank's update needs only its own pieces -- as Megatron's distributed optimizer
steps its local shards. Through the dispatcher the same update pays the Python subclass's cost per
tensor per op (1.8-2x plain torch where a step is launch-bound: benchmarks/optimizer.py); here it is
the plain call.

How: each optimizer's ``step`` gathers its lists (parameters, gradients, states, step counts) and calls
its module's functional update (``torch.optim.adam.adam``, ``torch.optim.sgd.sgd``, ...); that function is
wrapped (:func:`install_optimizer_pieces`). Given global tensors, the wrapper calls the original with
the pieces this process holds -- every held rank's pieces in one call in a simulated world, so torch's
foreach and fused kernels group them as they group a plain model's -- and with everything else as the
step passed it. ``state_dict()`` keeps the global tensors, whose pieces were updated in place, so DCP,
LR schedulers, hooks, ``add_param_group``, GradScaler and clipping work as before.

What a step costs above plain torch's is kept to a few passes in C over its lists: the lists the
optimizer's loop makes are reused while nothing they are made of changed (nn/optim_groups.py), and so
is the call's shape -- its order, placeholders, which arguments are which (nn/pieces_shape.py); each
step reads its tensors anew. Where the optimizer's step allows it (torch's elementwise classes but
SGD, not in a capture), the reused lists are the pieces themselves, kept between steps
(nn/kept_pieces.py): the update gets plain lists, and this wrapper passes them straight on.

Per element: a global gradient in another layout than its parameter's (``grad_sbp=``) is boxed to it
first (a partial one reduced); a 0-dim plain state (a step count, NAdam's ``mu_product``, ASGD's
``eta`` and ``mu``) is the same on every rank and changes with the step only, so each extra held rank
gets its own copy of it for the call; an element of which this process holds no piece goes in as empty
placeholders, so its step count advances as on every other rank.

Muon and Adafactor (:data:`WHOLE`) read each parameter whole -- Newton-Schulz matmuls, norms,
factored row and column statistics -- so they step on the pieces only where every parameter and
state is whole on its ranks (broadcast on every axis: data parallelism): each rank updates its copy
as the plain update would, Adafactor's states in their own shapes and its ``None`` entries kept.

Over split parameters (tensor parallel, a ZeroOptimizer's shards) they step on whole copies
(:class:`GatheredCall`): gathered, updated on every rank as on one device, each rank's part
written back.

The present path (the update dispatched op by op on global tensors) runs where this one would not be
exact or cannot apply: LBFGS, SparseAdam and any other optimizer (not elementwise, or not known to
be), ``differentiable=True``, sparse gradients, a state made lazily (SGD's momentum buffer at its first
step), a state or a gradient in a layout its parameter does not have, and while Dynamo traces a
``torch.compile``d step (the wrapper is inlined, and there it is the original).

Under ``gt.compile`` the call is one task of the graph (actor_rt/capture.py), run by each replay with
the settings of the optimizer's parameter group as they are then: a learning-rate schedule, a changed
weight decay or betas reach the next call with no new capture. A setting counts as the group's when
the step passed the group's own number object (``lr=group["lr"]``, ``beta1`` from ``group["betas"]``).
With ``cuda_graphs=True`` the update is recorded op by op instead (actor_rt/optim.py), so that the
graphs replay it.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import sys
from typing import Callable, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..boxing.interned import intern
from ..compat.dynamo import inlined_wrapper
from ..sbp import broadcast
from ..tensor import GlobalTensor, box, write_into
from . import mapped_call
from .optim_groups import ON_PIECES, reused_lists
from .pieces_shape import (CallShape, Shapes, dim_of, layout_of, order_of, pieces_of, states_over_order,
                           with_placeholders)

#: the torch.optim modules whose functional update (the module's own name) is elementwise
ELEMENTWISE = ("sgd", "adam", "adamw", "adagrad", "adadelta", "adamax", "asgd", "nadam", "radam", "rmsprop", "rprop")
#: the torch.optim modules whose functional update reads each parameter whole (Muon's Newton-Schulz
#: matmuls, Adafactor's norms and factored row / column statistics): their module -> function name
WHOLE = {"_muon": "muon", "_adafactor": "adafactor"}
#: the elementwise classes whose step reads its lists after the update: SGD writes each momentum buffer
#: back into the state by its parameter (their lists stay global; nn/kept_pieces.py)
READS_ITS_LISTS = frozenset({"SGD"})
#: number settings an optimizer reads only to make a state (Rprop's step sizes start at ``lr``), never in
#: its update: a graph holds its states, so a change needs no capture (tests/nn/test_optim_pieces.py
#: checks that every other number setting reaches the update)
STATE_INIT_ONLY = {"Rprop": ("lr",), "Adagrad": ("initial_accumulator_value",)}


class _Stepping:
    """The optimizer whose ``step`` runs now (global step hooks): where a capture finds its group."""
    optimizer: Optional[torch.optim.Optimizer] = None
    hooked = False


_stepping = _Stepping()


def install_optimizer_pieces() -> None:
    """Wrap the functional update of every :data:`ELEMENTWISE` and :data:`WHOLE` optimizer, and its
    class's loop that makes the update's lists (nn/optim_groups.py), once per process."""
    for module_name, name, whole in [(n, n, False) for n in ELEMENTWISE] + [(m, f, True) for m, f in WHOLE.items()]:
        try:
            module = importlib.import_module(f"torch.optim.{module_name}")
        except ImportError:                         # an optimizer this torch does not have
            continue
        fn = getattr(module, name, None)
        if callable(fn) and not hasattr(fn, "on_globals"):
            setattr(module, name, _stepping_pieces(fn, whole))
        for cls in vars(module).values():
            if not isinstance(cls, type) or not issubclass(cls, torch.optim.Optimizer):
                continue
            if "_init_group" in vars(cls):
                reused_lists(cls)
            if not whole and cls.__module__ == module.__name__ and cls.__name__ not in READS_ITS_LISTS:
                ON_PIECES.add(cls)
    if not _stepping.hooked:
        register_optimizer_step_pre_hook(lambda opt, args, kwargs: setattr(_stepping, "optimizer", opt))
        register_optimizer_step_post_hook(lambda opt, args, kwargs: setattr(_stepping, "optimizer", None))
        _stepping.hooked = True


#: the wrapper's code (:func:`_stepping_pieces`)
_WRAPPER = """
def update(*args, **kwargs):
    if is_compiling() or (args and args[0] and type(args[0][0]) is not global_tensor):
        return fn(*args, **kwargs)
    call = pieces_call(fn, names, args, kwargs, whole)
    if call is None:
        return fn(*args, **kwargs)
    return call.run()
"""


def _stepping_pieces(fn: Callable, whole: bool = False) -> Callable:
    """``fn`` wrapped: called with global tensors, the update on pieces (:class:`PiecesCall`); else ``fn``
    -- and while Dynamo traces it, ``fn`` (compat/dynamo.py, ``inlined_wrapper``). ``whole``: ``fn``
    reads each parameter whole (:data:`WHOLE`)."""
    namespace = {"fn": fn, "names": list(inspect.signature(fn).parameters), "pieces_call": _pieces_call,
                 "is_compiling": torch.compiler.is_compiling, "whole": whole,
                 "global_tensor": GlobalTensor}
    update = functools.wraps(fn)(inlined_wrapper(_WRAPPER, "update", namespace,
                                                 f"{fn.__module__}.{fn.__name__} on pieces"))
    update.on_globals = fn            # the original: the present path, op by op through the dispatcher
    return update


def _pieces_call(fn: Callable, names: list, args: tuple, kwargs: dict, whole: bool):
    bound = dict(zip(names, args))
    bound.update(kwargs)
    call = PiecesCall.of(fn, names, bound, whole)
    if call is None and whole:
        call = GatheredCall.of(fn, names, bound)
    return call


class GatheredCall:
    """A :data:`WHOLE` update over split parameters: every split parameter, gradient and state boxed
    whole onto its ranks (all-gathers; a partial gradient all-reduced), the update on those pieces
    (:class:`PiecesCall`: each rank the whole update, as one device), and each rank's part of the
    updated parameters and states written back into their own layouts (slices: no communication).
    Exact, at the price of the gathers -- which the update's own Newton-Schulz matmuls or norms over
    split tensors would make too."""

    def __init__(self, call: "PiecesCall", written: list):
        self.call, self.written = call, written

    @staticmethod
    def of(fn: Callable, names: list, bound: dict) -> Optional["GatheredCall"]:
        params = bound.get(names[0])
        if not params or any(type(p) is not GlobalTensor for p in params) or names[0] != "params":
            return None
        capture = mapped_call._capture
        if bound.get("differentiable") or (capture is not None and not capture.optimizer_tasks):
            return None                     # PiecesCall would refuse these: gather nothing for it
        grads = names[1]
        gathered, written = dict(bound), []
        for k in [k for k in names if type(bound.get(k)) is list and bound[k]]:
            values = list(bound[k])
            for i, v in enumerate(values):
                if type(v) is GlobalTensor and not _whole(v):
                    values[i] = box(v, intern(v._layout.with_sbp((broadcast,) * v.placement.ndim)))
                    if k != grads:
                        written.append((v, values[i]))
            gathered[k] = values
        call = PiecesCall.of(fn, names, gathered, whole=True)
        if call is None:
            return None
        call.first_param = params[0]            # its group's settings are read live (a schedule)
        return GatheredCall(call, written)

    def run(self) -> None:
        self.call.run()
        for target, updated in self.written:
            write_into(target, updated)


class PiecesCall:
    """One call of a functional update, on the pieces this process holds.

    Every list argument becomes a list over :attr:`order` -- ``(element, rank)`` for each rank this
    process holds of each parameter, ranks outermost where all parameters share a placement (then
    each list is made by a few whole-list operations, the step's per-parameter cost kept in C);
    ``(element, None)`` for an element held on no rank here (an empty placeholder). A global list
    gives its pieces there; a list of 0-dim plain states (step counts) gives each element's state at
    its first held rank and a copy made for the call at each other one.

    The tensors go in as one flat list (:attr:`inputs`, the order :meth:`rebuild` reads them back in):
    each global list's pieces over the order, each plain list's states, then the other tensor
    arguments (GradScaler's ``grad_scale`` and ``found_inf``, a tensor ``lr``). :attr:`written`: what
    the update writes -- every list's tensors but the gradients (those too for a fused update, which
    unscales them)."""

    def __init__(self, shape: CallShape, bound: dict, columns: dict):
        self.shape, self.fn = shape, shape.fn
        self.name = type(_stepping.optimizer).__name__ if _stepping.optimizer is not None else shape.fn.__name__
        self.first_param = bound["params"][0]
        self.settings = {k: bound[k] for k in shape.setting_names}
        self.live: dict = {}                      # setting name -> (group, key, index or None)
        self.inputs, self.written = [], []
        for k in shape.lists:
            values = columns[k]
            self.inputs.extend(values)
            if k != shape.grads or shape.fused:
                self.written.extend(values)
        self.inputs.extend(bound[k] for k in shape.tensor_args)

    @staticmethod
    def of(fn: Callable, names: list, bound: dict, whole: bool = False) -> Optional["PiecesCall"]:
        """The call on pieces for these arguments; None where the present path must run (module docstring).
        ``whole``: ``fn`` reads each parameter whole, so every parameter must be whole on its ranks."""
        params = bound.get(names[0])
        if not params or type(params[0]) is not GlobalTensor:
            return None
        capture = mapped_call._capture
        if capture is not None and not capture.optimizer_tasks:
            return None                     # recorded op by op, to be replayed inside CUDA graphs
        if bound.get("differentiable") or bound.get("has_sparse_grad") or names[0] != "params":
            return None
        key = _shapes.key(fn, whole, params)
        shape = _shapes.get(key)
        if shape is not None and shape.fits(bound):
            return PiecesCall(shape, bound, shape.columns(bound))
        if whole and not all(type(p) is GlobalTensor and _whole(p) for p in params):
            return None
        n, grads = len(params), names[1]
        lists = [k for k in names if type(bound.get(k)) is list and bound[k]]
        if any(len(bound[k]) != n for k in lists) or lists[:2] != ["params", grads]:
            return None
        if any(isinstance(v, GlobalTensor) for k, v in bound.items() if k not in lists):
            return None
        if set(map(type, params)) != _GLOBAL:
            return None
        layouts = list(map(layout_of, params))
        given, plain, holes = {"params": params}, set(), {}
        for k in lists[1:]:
            values = bound[k]
            kinds = set(map(type, values))
            if whole and kinds <= _GLOBAL_OR_NONE and k != grads:
                # a whole update's states have shapes of their own (Adafactor's row and column
                # statistics): whole on the parameter's ranks is what the call needs
                if not all(v is None or (v.placement == p.placement and _whole(v)) for v, p in zip(values, params)):
                    return None
                if None in values:
                    holes[k] = frozenset(i for i, v in enumerate(values) if v is None)
            elif kinds == _GLOBAL:
                values = _in_layouts(values, params, layouts, box_them=k == grads and not bound.get("fused"))
                if values is None:
                    return None
            elif kinds == _PLAIN and k != grads and set(map(dim_of, values)) == {0}:
                plain.add(k)
            else:
                return None             # None (a lazy state), a plain tensor beside global ones, sparse
            given[k] = values
        order, ranks = order_of(params, layouts)
        columns = {k: list(given[k]) if k in plain else
                   [given[k][i]._pieces[r] for i, r in order if r is not None and given[k][i] is not None]
                   if k in holes else pieces_of(given[k], order, ranks) for k in lists}
        shape = CallShape(fn, bound, lists, plain, holes, order, ranks, layouts, columns)
        _shapes.keep(key, shape)
        return PiecesCall(shape, bound, columns)

    def rebuild(self, tensors) -> dict:
        """The original's arguments from the flat tensors: each list over the order (placeholders and
        copies made now), the other tensor arguments, the settings (a live one as its group holds it now)."""
        shape, call, at = self.shape, {}, 0
        for k in shape.lists:
            if k in shape.plain:
                call[k] = states_over_order(list(tensors[at:at + shape.n]), shape.plain_order, shape.copies)
                at += shape.n
                continue
            pieces = list(tensors[at:at + shape.counts[k]])
            at += shape.counts[k]
            call[k] = self._with_holes(pieces, shape.holes[k]) if k in shape.holes else \
                with_placeholders(pieces, shape.placeholders)
        for k in shape.tensor_args:
            call[k] = tensors[at]
            at += 1
        call.update(self.settings)
        for name, (group, key, index) in self.live.items():
            call[name] = group[key] if index is None else group[key][index]
        return call

    def _with_holes(self, pieces: list, holes: frozenset) -> list:
        """A list over the order from its pieces: None for its elements without a state, a placeholder
        where no rank of the element is held here."""
        empty = {j: (dtype, device) for j, dtype, device in self.shape.placeholders}
        given = iter(pieces)
        out = []
        for j, (i, r) in enumerate(self.shape.order):
            if i in holes:
                out.append(None)
            elif r is None:
                out.append(torch.empty(0, dtype=empty[j][0], device=empty[j][1]))
            else:
                out.append(next(given))
        return out

    def __call__(self, *tensors):
        """Run the update on these tensors (a graph's task; the eager call passes :attr:`inputs`)."""
        self.fn(**self.rebuild(tensors))
        return ()

    def __str__(self) -> str:
        return f"{self.name} update on pieces"

    @property
    def rank(self) -> Optional[int]:
        """The rank whose stream runs it in a graph: the first this process holds of any parameter."""
        return next((r for _, r in self.shape.order if r is not None), None)

    def run(self) -> None:
        """Eagerly: the call now. In a capture: one task of the graph, its settings read at each replay."""
        capture = mapped_call._capture
        if capture is None:
            self(*self.inputs)
            return None
        self.live, unread = _live_settings(self.settings, self.first_param)
        capture.task(self, tuple(self.inputs), writes=tuple(self.written),
                     settings=tuple(self.live.values()) + unread)
        return None


_GLOBAL = {GlobalTensor}
_GLOBAL_OR_NONE = {GlobalTensor, type(None)}


def _whole(t: GlobalTensor) -> bool:
    """Every rank of ``t``'s placement holds all of it."""
    return all(v.is_broadcast for v in t._layout.nd_sbp)


_PLAIN = {torch.Tensor}
_shapes = Shapes()


def _in_layouts(values: list, params: list, layouts: list, box_them: bool) -> Optional[list]:
    """``values`` (a list of global tensors, one per parameter) each in its parameter's layout: an equal
    layout takes the parameter's interned object (and so does the parameter: later steps compare by
    identity); another one, where ``box_them`` (the gradients), is boxed to it (a partial gradient
    reduced); else None."""
    if list(map(layout_of, values)) == layouts:       # identities first: one pass in C
        return values
    out = list(values)
    for i, (v, p) in enumerate(zip(values, params)):
        if v._layout is p._layout:
            continue
        if v._layout == p._layout:
            v._layout = p._layout = intern(p._layout)
        elif box_them and v.shape == p.shape and v.dtype == p.dtype and v.placement == p.placement:
            out[i] = box(v, p._layout)
        else:
            return None
    return out


def _live_settings(settings: dict, first_param) -> tuple:
    """The settings passed as the stepping optimizer's group holds them: ``{name: (group, key, index)}``
    for each number that is the group's own object (``lr=group["lr"]``: index None; ``beta1`` from
    ``group["betas"]``: index 0), found once, unambiguously; and ``(group, key, None)`` of each of its
    :data:`STATE_INIT_ONLY` settings (read by no update: nothing to feed)."""
    opt = _stepping.optimizer
    group = None if opt is None else next((g for g in opt.param_groups
                                           if any(p is first_param for p in g["params"])), None)
    if group is None:
        return {}, ()
    unread = tuple((group, key, None) for key in STATE_INIT_ONLY.get(type(opt).__name__, ()) if key in group)
    live = {}
    for name, v in settings.items():
        if type(v) not in (float, int):
            continue
        if group.get(name) is v:
            live[name] = (group, name, None)
            continue
        found = [(k, j) for k, gv in group.items() if type(gv) is tuple for j, x in enumerate(gv) if x is v]
        if len(found) == 1:
            live[name] = (group, *found[0])
    return live, unread


def steps_on_pieces(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt.step()`` takes the path on pieces: a ``torch.optim`` class of :data:`ELEMENTWISE` or
    :data:`WHOLE` (a ``ZeroOptimizer``'s wrapped one) over global parameters only, none ``differentiable``."""
    from .zero import ZeroOptimizer
    if isinstance(opt, ZeroOptimizer):
        opt = opt._optimizer
    module = getattr(sys.modules.get(type(opt).step.__module__), "__name__", "")
    name = module.rsplit(".", 1)[-1]
    if not module.startswith("torch.optim.") or (name not in ELEMENTWISE and name not in WHOLE):
        return False
    return all(not g.get("differentiable") and all(type(p) is GlobalTensor for p in g["params"])
               for g in opt.param_groups)
