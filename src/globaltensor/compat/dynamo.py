"""Library calls that ``torch.compile`` traces without reading their Python (``gt.to_global``,
``full_tensor``, ``gt.distribute``), and the library's values it takes as constants (placements,
SBP values). ``local_tensors()`` returns a dict, which no call in a graph may: it breaks the graph
once, Dynamo's reason naming it.

They box or hand out pieces in Python that Dynamo's bytecode tracing cannot follow (it would stop
inside the library, with screens of internal errors). Marked *nonstrict-traced*, each is one opaque
call in Dynamo's graph, which AOTAutograd then traces through: its boxing becomes the graph's
collectives, like an op's. Their non-tensor arguments (placements, SBP values) are pytree
constants, so they may be passed.

Marking needs ``torch._dynamo``, whose import takes about 2 s: the functions are marked when it is
imported -- by ``torch.compile``'s first call, or before globaltensor -- not with globaltensor. A
function is marked by its identity (Dynamo's own lists of nonstrict-traced callables), so every
name bound to it -- ``gt.to_global``, ``globaltensor.from_local.to_global`` -- is covered; a torch
without those lists (before 2.7) has no ``nonstrict_trace``, and the calls break the graph there.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Callable, List

import torch.utils._pytree as pytree

_MARKED: List[Callable] = []
_CONSTANTS: List[type] = []


def trace_through(fn: Callable) -> Callable:
    """Have ``torch.compile`` trace ``fn`` nonstrictly (see the module's docstring); returns ``fn``."""
    _MARKED.append(fn)
    if "torch._dynamo" in sys.modules:
        _skip_library()
        _mark(fn)
    else:
        _install_hook()
    return fn


def constant(cls: type, recipe: Callable) -> type:
    """``cls`` (hashable, compared by value) may be an argument of a nonstrict-traced call, and a
    constant Dynamo guards on; a tensor method given one (``x.to_global(sbp=B)``) goes into Dynamo's
    graph as a method call, where an FX node rebuilds the value: ``recipe(value)`` gives the
    callable and its plain arguments (torch.fx's ``__fx_create_arg__`` hook)."""
    register = getattr(pytree, "register_constant", None)
    if register is not None:
        register(cls)
    cls.__fx_create_arg__ = lambda value, tracer: _rebuilt(tracer, *recipe(value))
    _CONSTANTS.append(cls)
    if "torch._dynamo" in sys.modules:
        _mark_constants()
    else:
        _install_hook()
    return cls


def _rebuilt(tracer, make: Callable, args: tuple):
    """A node of ``tracer``'s graph calling ``make(*args)``, as torch.fx rebuilds a dataclass."""
    return tracer.create_node("call_function", make, tuple(tracer.create_arg(a) for a in args), {})


def _mark_constants() -> None:
    from torch._dynamo import utils
    types = getattr(utils, "common_constant_types", None)
    if isinstance(types, set):
        types.update(_CONSTANTS)


def inlined_wrapper(source: str, name: str, namespace: dict, where: str) -> Callable:
    """Function ``name`` of ``source`` (its globals ``namespace``), compiled under the file name
    ``<globaltensor: where>``. Dynamo never traces the library's own files (:func:`_skip_library`), yet
    a wrapper of a torch function that a compiled program of plain tensors calls (an optimizer's update,
    a clipping) must be inlined as the function it wraps was, not break the graph: so its code has a
    file of its own. Such a wrapper decides in its own lines, on what Dynamo can trace (a type, a
    flag), whether to call the library at all."""
    exec(compile(source, f"<globaltensor: {where}>", "exec"), namespace)
    return namespace[name]


def _skip_library() -> None:
    """Dynamo never compiles a frame of the library's own code: the dispatcher's frames that run
    eagerly after a graph break (an op whose output shape depends on the data) would otherwise be
    compiled in turn, and fail deep inside it. AOTAutograd still traces the dispatcher."""
    from torch._dynamo import trace_rules
    add = getattr(trace_rules, "add", None)
    if add is not None:
        add("globaltensor")


def _mark(fn: Callable) -> None:
    from torch._dynamo import trace_rules
    allowed = getattr(trace_rules, "_allowed_callable_ids", None)
    nonstrict = getattr(trace_rules, "_nonstrict_trace_callable_ids", None)
    if allowed is not None and nonstrict is not None:
        allowed.add(id(fn))             # the functions live as long as the library: their ids are theirs
        nonstrict.add(id(fn))


class _AfterDynamo(importlib.abc.MetaPathFinder):
    """Marks the functions once ``torch._dynamo`` has been imported, then takes itself out."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch._dynamo":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        original = spec.loader.exec_module

        def exec_module(module):
            original(module)
            _skip_library()
            for fn in _MARKED:
                _mark(fn)
            _mark_constants()
        spec.loader.exec_module = exec_module
        return spec


_hook = None


def _install_hook() -> None:
    global _hook
    if _hook is None:
        _hook = _AfterDynamo()
        sys.meta_path.insert(0, _hook)
