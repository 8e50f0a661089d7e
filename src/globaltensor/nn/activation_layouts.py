"""Plan entries for activations: a module's input or output boxed to a layout where it enters or leaves.

    {"*.mlp.up_proj:input": (None, B), "*.mlp.down_proj:output": (None, S(1))}

A key ``"<module pattern>:input"`` boxes the first tensor argument of every module the pattern
matches (positional, else keyword) before its forward; ``"<module pattern>:output"`` boxes its
result (the first element of a tuple result) after. ``":input[i]"`` names the ``i``-th positional
argument, ``":input[name]"`` the keyword argument ``name``, ``":output[i]"`` the ``i``-th element
of a tuple result (DTensor's ``PrepareModuleInput`` / ``PrepareModuleOutput``: parallel_styles.py);
one that is not a global tensor is left as it is. The value gives an SBP per placement axis,
``None`` for an axis the tensor keeps as it comes (the data axis of a 2-D placement, say); a
negative split dim counts from the tensor's last. That is
how Megatron's sequence parallelism is asked for (``megatron_plan(..., sequence_parallel=True)``):
activations stay split on the sequence between the tensor-parallel regions, gathered on entering
a column-parallel layer and reduce-scattered on leaving a row-parallel one; the boxings'
gradients are the reverse collectives, so the backward follows by itself. The hooks trace into a
``torch.compile``d module's graph: Megatron-SP compiles with no graph break.
"""
from __future__ import annotations

from fnmatch import fnmatchcase
from typing import List, Optional, Tuple

import torch
from torch import nn

from ..compat.dynamo import inlined_wrapper
from ..placement import Placement
from ..sbp.nd import normalize_split
from ..sbp.values import SbpValue
from ..tensor import GlobalTensor

WHERE = ("input", "output")


def _where(key: str) -> Optional[tuple]:
    """``("input" | "output", position)`` of an activation key's part after its last colon --
    position None for the first tensor, an int index or a keyword name -- or None."""
    where, bracket, rest = key.partition("[")
    if where not in WHERE:
        return None
    if not bracket:
        return where, None
    if not rest.endswith("]") or not rest[:-1]:
        return None
    at = rest[:-1]
    if at.isdigit():
        return where, int(at)
    return (where, at) if where == "input" and at.isidentifier() else None


def is_activation_key(pattern: str) -> bool:
    return ":" in pattern and _where(pattern.rsplit(":", 1)[-1]) is not None


def check_activation_entry(pattern: str, value, placement_ndim=None) -> tuple:
    """``(module pattern, ("input" | "output", position), per-axis SBPs or None)`` of a plan entry;
    TypeError or ValueError naming the pattern for a value that is not one SBP or None per axis."""
    values = (value,) if isinstance(value, SbpValue) else value
    if not isinstance(values, (tuple, list)) or not values or \
            not all(v is None or isinstance(v, SbpValue) for v in values) or all(v is None for v in values):
        raise TypeError(f"plan[{pattern!r}]: expected an SBP, or a tuple with one SBP or None (kept as it comes) "
                        f"per placement axis, got {value!r}")
    if any(v is not None and v.is_partial for v in values):
        raise ValueError(f"plan[{pattern!r}]: an activation entry boxes to split or broadcast, not partial_sum; "
                         f"got {value!r}")
    if placement_ndim is not None and len(values) != placement_ndim:
        raise ValueError(f"plan[{pattern!r}]: {len(values)} SBP entries for a placement of {placement_ndim} axes")
    module_pattern, where = pattern.rsplit(":", 1)
    return module_pattern, _where(where), tuple(values)


def install(module: nn.Module, placement: Placement, entries: List[Tuple[str, object]], strict: bool) -> None:
    """Hooks boxing the inputs and outputs the activation ``entries`` name (see the module doc)."""
    checked = [(pattern, *check_activation_entry(pattern, value, placement.ndim)) for pattern, value in entries]
    used = set()
    for name, mod in module.named_modules():
        for key, pattern, where, values in checked:
            if fnmatchcase(name, pattern):
                used.add(key)
                if where[0] == "input":
                    mod.register_forward_pre_hook(_box_input(values, where[1]), with_kwargs=True)
                else:
                    mod.register_forward_hook(_box_output(values, where[1]))
    unused = [key for key, *_ in checked if key not in used]
    if strict and unused:
        raise ValueError(f"distribute_module: plan pattern(s) {unused} match no module of {type(module).__name__} "
                         f"(pass strict=False to allow); module names look like "
                         f"{[n for n, _ in module.named_modules()][1:5]}")


def _boxed(t, values: tuple):
    """``t`` boxed to ``values``; the result is kept on ``t`` (while ``t`` is unchanged), so that the
    layers reading one input -- q, k and v projections -- share one gather, and their gradients
    meet before one reduce-scatter back."""
    nd = tuple(t.sbp[a] if v is None else normalize_split(v, t.dim()) for a, v in enumerate(values))
    if nd == t.sbp:
        return t
    kept = t.__dict__.get("_entry_boxed")
    if kept is not None and kept[0] == nd and kept[1] == t._version:
        return kept[2]
    out = t.to_global(sbp=nd)
    t._entry_boxed = (nd, t._version, out)
    return out


#: the hooks' code, in a file of its own (compat/dynamo.py ``inlined_wrapper``): ``torch.compile``
#: traces a hook into the module's graph -- there the boxing is ``to_global``, which Dynamo traces
#: (one gather per reading layer; the graph's compiler may merge them; a negative split dim is
#: to_global's to resolve), eagerly :func:`_boxed`.
#: ``at``: None (the first tensor), a position, or a keyword name.
_HOOKS = """
def boxed(t):
    if not isinstance(t, GlobalTensor):
        return t
    if is_compiling():
        nd = tuple(t.sbp[a] if v is None else v for a, v in enumerate(values))
        return t if nd == t.sbp else t.to_global(sbp=nd)
    return eagerly(t, values)


def box_input(module, args, kwargs):
    if type(at) is int:
        if at < len(args):
            return args[:at] + (boxed(args[at]),) + args[at + 1:], kwargs
        return None
    if at is not None:
        return (args, dict(kwargs, **{at: boxed(kwargs[at])})) if at in kwargs else None
    for i, a in enumerate(args):
        if isinstance(a, GlobalTensor):
            return args[:i] + (boxed(a),) + args[i + 1:], kwargs
    for k, a in kwargs.items():
        if isinstance(a, GlobalTensor):
            return args, dict(kwargs, **{k: boxed(a)})
    return None


def box_output(module, args, out):
    if isinstance(out, tuple) and out:
        i = at or 0
        return out[:i] + (boxed(out[i]),) + out[i + 1:] if i < len(out) else out
    return boxed(out) if not at else out
"""


def _hook(name: str, values: tuple, at):
    """The hook ``name`` of :data:`_HOOKS` boxing to ``values`` the argument or result ``at`` names."""
    namespace = {"values": values, "at": at, "GlobalTensor": GlobalTensor,
                 "is_compiling": torch.compiler.is_compiling, "eagerly": _boxed}
    return inlined_wrapper(_HOOKS, name, namespace, "activation entry")


def _box_input(values: tuple, at=None):
    return _hook("box_input", values, at)


def _box_output(values: tuple, at=None):
    return _hook("box_output", values, at)
