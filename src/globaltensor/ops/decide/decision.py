"""A Decision: how one call of an op runs, as data.

The decide stages make it once per cache key (route -> candidates -> cost); the executor runs
every kind (ops/executor/). The traced modes read the same object: ``gt.compile``'s capture
labels its tasks with the chosen signature, and ``torch.compile`` traces the executor's run of it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ...boxing import Layout
from ...boxing.interned import intern
from ..schema.op_record import record
from .candidates import Problem
from .cost import gradient_under
from .route import Route


@dataclass(eq=False, slots=True)
class Decision:
    route: str                          # the route's kind (decide/route.py), or "write_back" (below)
    func: object
    positions: list = field(default_factory=list)    # where the tensor arguments sit (schema/args.py)
    targets: list = field(default_factory=list)      # the Layout each tensor input is boxed to
    out_kind: str = "tensor"                         # "tensor" | "tuple" | "list" | "none"
    out_layouts: list = field(default_factory=list)  # the Layout of each tensor output
    out_slots: Optional[list] = None    # a tuple / list result: which entries are tensors (others None or numbers)
    local: Optional[Callable] = None    # the rule's per-rank rewrite of the arguments
    kernel: Optional[Callable] = None   # the rule's kernel: runs the call over the held ranks (it may communicate)
    written: list = field(default_factory=list)      # tensor-input indices of the tensors the op writes
    returned: dict = field(default_factory=dict)     # output position -> tensor-input index it returns
    view_base: Optional[tuple] = None   # (position, target) of the input a view op's result aliases
    signature: object = None            # the chosen NdSignature
    list_kind: Optional[str] = None     # a list op: "foreach" | "fused" | "unscale"
    lists: object = None                # a list op's plan (decide/lists.py)
    decomposition: Optional[Callable] = None
    placement_to: object = None         # an "align" route: the placement the op runs on
    marks: list = field(default_factory=list)        # (position, axes): an input whose gradient is partial there
    run: Optional[Callable] = field(default=None, repr=False)    # the executor's runner of it

    @property
    def placement(self):
        return (self.targets or self.out_layouts)[0].placement


def on_pieces(r: Route, problem: Problem, chosen) -> Decision:
    """The decision to run the op (or its rule's kernel) on each rank's pieces with signature ``chosen``."""
    targets = [intern(lay.with_sbp(nd)) for lay, nd in zip(problem.in_layouts, chosen.inputs)]
    out_layouts = [intern(Layout(shape, dtype, problem.placement, nd))
                   for (shape, dtype), nd in zip(problem.out_meta, chosen.outputs)]
    slots = [isinstance(o, torch.Tensor) for o in r.meta_out] if r.out_kind in ("tuple", "list") else None
    return Decision("local", r.func, r.positions, targets, r.out_kind, out_layouts, slots, r.rule.local,
                    r.rule.kernel, problem.written, problem.returned, _view_base(r, targets), chosen,
                    marks=_partial_gradients(r, problem, targets, chosen))


def _partial_gradients(r: Route, problem: Problem, targets: list, chosen) -> list:
    """``(position, axes)`` of each recorded input whose gradient the signature makes partial on
    ``axes``: the executor marks its gradient's sink (ops/gradient_sinks.py)."""
    marks = []
    for k, (target, recorded) in enumerate(zip(targets, problem.recorded)):
        axes = tuple(a for a, v in enumerate(gradient_under(target, chosen).nd_sbp) if v.is_partial) \
            if recorded else ()
        if axes:
            marks.append((r.positions[k], axes))
    return marks


def through_twin(r: Route, problem: Problem) -> Decision:
    """The decision for a rule op whose candidates cannot keep a written tensor's layout: its
    functional twin runs and the result is written back (writes/written_inputs.py)."""
    return Decision("write_back", r.func, r.positions, written=problem.written)


def _view_base(r: Route, targets: list) -> Optional[tuple]:
    """(position, target) of the tensor input a view op's result aliases; None for other ops."""
    rec = record(r.func)
    if rec.view_of is None or not targets:
        return None
    name = rec.args[rec.view_of].name
    for pos, target in zip(r.positions, targets):
        where, key, item = pos
        if item is None and ((where == 0 and key == rec.view_of) or (where == 1 and key == name)):
            return pos, target
    return r.positions[0], targets[0]
