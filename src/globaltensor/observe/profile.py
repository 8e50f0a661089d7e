"""The communication profiler: every collective with what caused it.

    with gt.comm_profile(model) as prof:
        loss = model(x).sum(); loss.backward(); opt.step()
    print(prof.table())          # rows by op, module, phase, collective, group and conversion
    print(prof.tree())           # the module tree, forward and backward under each module
    prof.to_json()               # everything, for tools

A profile records what ``gt.comm_stats()`` records -- it *is* a :class:`CommStats`, with the same
totals -- and for each collective also the op whose dispatch ran it (``aten.mm``; ``to_global``
for conversions the user asked for, including ``full_tensor()`` and their backward;
``grad read`` when reading a gradient reduces it; ``gradient bucket``; ``gt.compile graph`` for
a compiled graph's run), the module whose forward or backward was running (qualified names
from hooks on ``model``'s modules), the phase, and the boxing that caused it (source layout ->
target layout). Collectives that a ``gt.compile`` capture runs are not counted (the graph runs
them again, each call); the profile keeps them apart, as ``captured``, attributed alike.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from ..comm import stats
from . import context as profile_context
from . import report as profile_report
from .report import GLOBAL
from .text import conversion_text, tensor_text


@dataclass(frozen=True)
class Conversion:
    """A boxing's source and target layouts: the SBP conversion that caused a collective."""
    shape: tuple
    dtype: torch.dtype
    src_placement: object
    src_sbp: tuple
    dst_placement: object
    dst_sbp: tuple

    @classmethod
    def of(cls, plan) -> "Conversion":
        src, dst = plan.src, plan.dst
        return cls(tuple(src.shape), src.dtype, src.placement, src.nd_sbp, dst.placement, dst.nd_sbp)

    def __str__(self) -> str:
        return conversion_text(self.src_placement, self.src_sbp, self.dst_placement, self.dst_sbp)

    @property
    def tensor(self) -> str:
        """``8x5 float32``."""
        return tensor_text(self.shape, self.dtype)

    def to_dict(self) -> dict:
        return {"shape": list(self.shape), "dtype": str(self.dtype).replace("torch.", ""),
                "from": {"placement": repr(self.src_placement), "sbp": [repr(v) for v in self.src_sbp]},
                "to": {"placement": repr(self.dst_placement), "sbp": [repr(v) for v in self.dst_sbp]},
                "text": str(self)}


@dataclass(frozen=True)
class CommEvent:
    """One collective and what caused it."""
    collective: str                  # all_gather, reduce_scatter, all_reduce, all_to_all, broadcast, send_recv
    group: tuple                     # its ranks
    bytes_per_rank: Dict[int, int]   # what each rank sends, as gt.comm_stats() counts it
    op: str                          # "aten.mm", "to_global", "grad read", "gradient bucket", "gt.compile graph"
    module: str                      # qualified module name ("GPT.blocks.0.mlp"), or "Global"
    phase: str                       # "forward" or "backward" (or what the cause names: "compiled")
    conversion: Optional[Conversion]  # the boxing that issued it; None for collectives no boxing plan issued

    @property
    def bytes(self) -> int:
        """The most bytes any one rank sends in this collective."""
        return max(self.bytes_per_rank.values(), default=0)

    def to_dict(self) -> dict:
        return {"collective": self.collective, "group": list(self.group), "bytes": self.bytes,
                "bytes_per_rank": {str(r): b for r, b in self.bytes_per_rank.items()}, "op": self.op,
                "module": self.module, "phase": self.phase,
                "conversion": None if self.conversion is None else self.conversion.to_dict()}


@dataclass
class CommProfile(stats.CommStats):
    """What ``gt.comm_profile()`` records: the totals of ``gt.comm_stats()`` (``bytes_sent``,
    ``per_rank``, ``count``, ``records``) and each collective with its cause (``events``).

    ``captured`` holds the collectives a ``gt.compile`` capture ran inside the profile (not in
    the totals: the compiled graph runs them again on each call, counted as ``gt.compile graph``).
    """
    events: List[CommEvent] = field(default_factory=list)
    captured: List[CommEvent] = field(default_factory=list)
    module_types: Dict[str, str] = field(default_factory=dict)
    tracker: Optional["_ModuleTracker"] = field(default=None, repr=False, compare=False)

    def add(self, record: stats.CollectiveRecord) -> None:
        super().add(record)
        self.events.append(self._event(record))

    def add_paused(self, record: stats.CollectiveRecord) -> None:
        self.captured.append(self._event(record))

    def _event(self, record: stats.CollectiveRecord) -> CommEvent:
        op, phase = profile_context.current_label()
        plan = profile_context.current_plan()
        module = self.tracker.current() if self.tracker is not None else GLOBAL
        return CommEvent(record.op, record.group, record.bytes_per_rank, op, module, phase,
                         None if plan is None else Conversion.of(plan))

    # -- reports ----------------------------------------------------------------------------------
    def rows(self, by: Sequence[str] = profile_report.KEYS, captured: bool = False) -> List[dict]:
        """The events grouped by the fields ``by`` (any of op, module, phase, collective, group,
        conversion), dearest first: each row has those fields, ``calls``, ``bytes`` (the most any
        one rank sent in the row's collectives) and ``bytes_per_rank``. Rank by rank, the rows add
        up to ``per_rank``, the totals of ``gt.comm_stats()``. ``captured=True``: the captured ones."""
        return profile_report.rows(self.captured if captured else self.events, by)

    def table(self, by: Sequence[str] = profile_report.KEYS, captured: bool = False) -> str:
        """The rows as an aligned text table, with the totals."""
        events = self.captured if captured else self.events
        title = ("Collectives run by gt.compile captures (not counted: the graph runs them on each call)"
                 if captured else "Communication profile")
        return profile_report.table(title, events, by)

    def tree(self, captured: bool = False) -> str:
        """The module tree, like DTensor's CommDebugMode's: under each module (totals including its
        submodules), its own collectives by phase, op, collective and conversion."""
        return profile_report.tree(self.captured if captured else self.events, self.module_types)

    def to_dict(self) -> dict:
        """Totals, rows, events and captured events, as plain data."""
        return {"collectives": self.count, "bytes_sent": self.bytes_sent,
                "bytes_per_rank": {str(r): b for r, b in sorted(self.per_rank.items())},
                "rows": self.rows(), "modules": self.module_types,
                "events": [e.to_dict() for e in self.events],
                "captured": [e.to_dict() for e in self.captured]}

    def to_json(self, path: Optional[str] = None, indent: int = 1) -> str:
        """:meth:`to_dict` as JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    def __repr__(self) -> str:
        return f"CommProfile(collectives={self.count}, bytes_sent={self.bytes_sent}, captured={len(self.captured)})"


class comm_profile:
    """Record every collective run inside, with the op, module, phase and conversion that caused it.

        with gt.comm_profile(model) as prof:
            ...
        print(prof.table()); print(prof.tree()); prof.to_json("comm.json")

    ``module``: an ``nn.Module`` whose submodules' forward and backward the collectives are
    attributed to, by qualified name with the root's class name first (``GPT.blocks.0.attn``);
    collectives outside them go to ``Global``. Hooks on its modules live while the profile is open.
    Without a module every collective's module is ``Global``. Returns a :class:`CommProfile`.
    """

    def __init__(self, module: Optional[torch.nn.Module] = None):
        if module is not None and not isinstance(module, torch.nn.Module):
            raise TypeError(f"comm_profile(module): expected a torch.nn.Module or None, got {type(module).__name__}")
        self.module = module

    def __enter__(self) -> CommProfile:
        tracker = None if self.module is None else _ModuleTracker(self.module)
        self.profile = CommProfile(tracker=tracker, module_types=dict(tracker.types) if tracker else {})
        stats.start_recording(self.profile)
        profile_context.profile_opened()
        return self.profile

    def __exit__(self, *exc) -> None:
        profile_context.profile_closed()
        stats.stop_recording(self.profile)
        if self.profile.tracker is not None:
            self.profile.tracker.close()


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _ModuleTracker:
    """Which module of a model runs now, its forward or its backward.

    Forward: a module runs from its forward pre-hook to its forward hook. Backward: from the
    moment autograd computes the gradient of any of its outputs (a multi-grad hook on them) to
    the moment it has computed those of all its inputs that need one (a multi-grad hook on them),
    or else to the end of the backward. The running module is the deepest of those running, the
    one entered last among equals: the innermost in the forward; in the backward, the innermost
    of those whose backward began (a module and its last submodule share an output, and so
    begin together), the latest of siblings.
    """

    def __init__(self, root: torch.nn.Module):
        self.types: Dict[str, str] = {}
        self.active: List[str] = []
        self.before_backward: Optional[List[str]] = None    # set while a backward with our hooks runs
        self.open = True
        self.handles = []
        root_name = type(root).__name__
        for qualified, m in root.named_modules():
            name = f"{root_name}.{qualified}" if qualified else root_name
            self.types[name] = type(m).__name__
            self.handles.append(m.register_forward_pre_hook(self._forward_starts(name)))
            self.handles.append(m.register_forward_hook(self._forward_ends(name), always_call=True))

    def current(self) -> str:
        if not self.active:
            return GLOBAL
        return max(enumerate(self.active), key=lambda e: (e[1].count("."), e[0]))[1]

    def close(self) -> None:
        self.open = False
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _leave(self, name: str) -> None:
        for i in range(len(self.active) - 1, -1, -1):
            if self.active[i] == name:
                del self.active[i]
                return

    def _forward_starts(self, name: str):
        def hook(module, args):
            if not self.open:
                return
            self.active.append(name)
            needing = _needing_grad(args)
            if needing and not _in_backward():
                register_multi_grad_hook(needing, lambda grads: self._backward_ends(name))
        return hook

    def _forward_ends(self, name: str):
        def hook(module, args, output):
            if not self.open:
                return
            self._leave(name)
            needing = _needing_grad(output)
            if needing and not _in_backward():
                register_multi_grad_hook(needing, lambda grads: self._backward_starts(name), mode="any")
        return hook

    def _backward_starts(self, name: str) -> None:
        if not self.open:
            return
        if self.before_backward is None:
            self.before_backward = list(self.active)
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        self.active.append(name)

    def _backward_ends(self, name: str) -> None:
        if self.open and self.before_backward is not None:
            self._leave(name)

    def _backward_done(self) -> None:
        """The end of the backward: modules whose inputs needed no gradient end here."""
        self.active[:] = self.before_backward or []
        self.before_backward = None


def _needing_grad(tree) -> list:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
