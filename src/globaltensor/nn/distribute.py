"""``distribute_module``: lay a module's parameters and buffers out as global tensors, by plan.

    model = GPT(cfg)                                    # plain PyTorch, same init on every rank
    gt.nn.distribute_module(model, placement, {"*.attn.qkv.weight": (B, S(0)), ...})
    loss = model.loss(idx, targets)                     # idx global: batch split on the data axis

Each parameter becomes ``nn.Parameter(gt.distribute(value, placement, sbp))`` in place -- the
existing value is taken as the whole logical tensor, identical on every rank (seed the
initialisation alike), and each rank keeps its slice. Buffers are distributed the same way.
Names no plan pattern matches are broadcast on every placement axis. A parameter shared by
several modules (tied weights) stays shared. Keys ending ``:input`` / ``:output`` name modules
whose input or output is boxed to a layout (activation_layouts.py).
"""
from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Dict, Iterable, List, Mapping, Tuple, Union

import torch
from torch import nn

from ..placement import Placement
from ..sbp import as_nd_sbp, broadcast
from ..sbp.values import SbpValue
from ..from_local import distribute
from ..tensor import GlobalTensor
from .activation_layouts import check_activation_entry, install as install_activation_layouts, is_activation_key
from .grad_buckets import DEFAULT_BUCKET_BYTES, GradBuckets, bucket_gradients
from .parallel_styles import HF_STYLES, from_parallel_styles, is_parallel_style

PlanLike = Union[None, Mapping[str, object], Iterable[Tuple[str, object]]]


def _styles_translated(module: nn.Module, placement: Placement, plan: PlanLike) -> PlanLike:
    """``plan`` with its DTensor parallel styles and HF style names (parallel_styles.py) translated on a
    1-D placement; its SBP entries come first, so they take precedence."""
    if not isinstance(plan, Mapping) or not any(is_parallel_style(v) for v in plan.values()):
        return plan
    styles = {k: v for k, v in plan.items() if is_parallel_style(v)}
    for pattern, value in styles.items():
        if isinstance(value, str) and value not in HF_STYLES:
            raise TypeError(f"plan[{pattern!r}]: expected an SBP (split(d), broadcast), a tuple of them, or a parallel "
                            f"style (DTensor's, or an HF name: {sorted(HF_STYLES)}), got {value!r}")
        if placement.ndim != 1:
            raise TypeError(f"plan[{pattern!r}]: a parallel style ({value!r}) on a placement of {placement.ndim} axes; "
                            f"say which axis is tensor parallel: gt.nn.from_parallel_styles(module, styles, axis=..., "
                            f"ndim={placement.ndim})")
    return {**{k: v for k, v in plan.items() if k not in styles}, **from_parallel_styles(module, styles)}


def _entries(plan: PlanLike) -> List[Tuple[str, object]]:
    if plan is None:
        return []
    if isinstance(plan, Mapping):
        items = list(plan.items())
    elif isinstance(plan, (str, bytes)) or not isinstance(plan, Iterable):
        raise TypeError(f"plan: expected a mapping {{pattern: sbp}} or (pattern, sbp) pairs, got {plan!r}")
    else:
        items = []
        for item in plan:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise TypeError(f"plan: expected (pattern, sbp) pairs, got the entry {item!r}")
            items.append(item)
    for pattern, value in items:
        if not isinstance(pattern, str):
            raise TypeError(f"plan: a pattern must be a str (fnmatch-style, e.g. '*.attn.qkv.weight'), "
                            f"got {pattern!r}")
        if is_activation_key(pattern):
            check_activation_entry(pattern, value)
            continue
        ok = isinstance(value, SbpValue) or (isinstance(value, (tuple, list)) and len(value) > 0 and
                                             all(isinstance(v, SbpValue) for v in value))
        if not ok:
            raise TypeError(f"plan[{pattern!r}]: expected an SBP (split(d), broadcast, partial_sum) or a tuple "
                            f"of them, one per placement axis, got {value!r} ({type(value).__name__})")
        if any(v.is_partial for v in ((value,) if isinstance(value, SbpValue) else value)):
            raise ValueError(f"plan[{pattern!r}]: a parameter cannot be partial_sum (its value would be ambiguous "
                             f"to the optimizer); use split or broadcast, got {value!r}")
    return items


def _named_tensors(module: nn.Module, kind: str):
    """``(full name, owner module, attribute name, tensor)`` for every parameter or buffer, shared ones
    under every name they have."""
    for prefix, mod in module.named_modules(remove_duplicate=False):
        slots = mod._parameters if kind == "parameter" else mod._buffers
        for attr, t in slots.items():
            if t is not None:
                yield (f"{prefix}.{attr}" if prefix else attr), mod, attr, t


def _layout_for(name: str, t: torch.Tensor, placement: Placement, entries, used: set) -> tuple:
    for pattern, value in entries:
        if fnmatchcase(name, pattern):
            used.add(pattern)
            return as_nd_sbp(value, placement.ndim, t.dim(), f"plan[{pattern!r}] for {name} of shape "
                                                             f"{tuple(t.shape)}")
    return (broadcast,) * placement.ndim


def match_plan(module: nn.Module, placement: Placement, plan: PlanLike = None, *,
               strict: bool = True) -> Dict[str, tuple]:
    """The nd-SBP each parameter and buffer of ``module`` would get (by its full name); nothing moves.

    Raises TypeError for a plan entry that is not an SBP or tuple of SBPs (naming its pattern),
    ValueError for an nd-SBP that does not fit the placement or the tensor, for a shared tensor
    given two layouts, and -- with ``strict`` -- for patterns that match nothing.
    """
    if not isinstance(placement, Placement):
        raise TypeError(f"distribute_module(placement=): expected a globaltensor placement, got {placement!r}")
    if not isinstance(module, nn.Module):
        raise TypeError(f"distribute_module: expected an nn.Module, got {type(module).__name__}")
    plan = _styles_translated(module, placement, plan)
    entries = [(p, v) for p, v in _entries(plan) if not is_activation_key(p)]
    used: set = set()
    out: Dict[str, tuple] = {}
    by_id: Dict[int, Tuple[str, tuple]] = {}
    for kind in ("parameter", "buffer"):
        for name, _, _, t in _named_tensors(module, kind):
            nd = _layout_for(name, t, placement, entries, used)
            first = by_id.get(id(t))
            if first is not None and first[1] != nd:
                raise ValueError(f"distribute_module: {name} and {first[0]} are the same tensor but the plan "
                                 f"gives them different layouts: {nd} and {first[1]}")
            by_id.setdefault(id(t), (name, nd))
            out[name] = nd
    unused = [p for p, _ in entries if p not in used]
    if strict and unused:
        raise ValueError(f"distribute_module: plan pattern(s) {unused} match no parameter or buffer of "
                         f"{type(module).__name__} (pass strict=False to allow); names look like "
                         f"{list(out)[:4]}")
    return out


def _place(t: torch.Tensor, placement: Placement, nd: tuple) -> GlobalTensor:
    """``t`` laid out as ``nd``, in pieces of its own: ``clone`` so that no piece shares storage with
    ``t`` (the first rank's piece of a broadcast would be ``t`` itself, and boxing may slice views
    of it): in-place optimizer updates must not write into the module's former tensors."""
    with torch.no_grad():
        if isinstance(t, GlobalTensor):
            return t.detach().to_global(placement, nd).clone()
        return distribute(t.detach(), placement, nd).clone()


def distribute_module(module: nn.Module, placement: Placement, plan: PlanLike = None, *,
                      strict: bool = True, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> nn.Module:
    """Replace every parameter of ``module`` by ``nn.Parameter`` of a global tensor laid out as
    ``plan`` says, and every buffer by a global tensor; in place. Returns ``module``.

    ``plan`` maps fnmatch-style patterns over the full names (``module.named_parameters()``
    names; buffers too) to an SBP or nd-SBP tuple; the first matching pattern decides and
    unmatched names are broadcast on every axis. The current values are the logical tensors:
    they must be equal on every rank. With ``strict`` (default) a pattern matching nothing is
    an error (a typo would otherwise leave a layer replicated silently).

    Data-parallel gradients (partial over an axis where the batch is split) are reduced in
    buckets of about ``bucket_bytes``, overlapped with the backward (grad_buckets.py); 0 leaves
    each to be reduced when read. ``gt.nn.no_sync(module)`` accumulates without reducing.
    """
    GradBuckets(bucket_bytes)           # validates before anything moves
    if isinstance(placement, Placement) and isinstance(module, nn.Module):
        plan = _styles_translated(module, placement, plan)
    layouts = match_plan(module, placement, plan, strict=strict)
    activations = [(p, v) for p, v in _entries(plan) if is_activation_key(p)]
    done: Dict[int, torch.Tensor] = {}
    for kind in ("parameter", "buffer"):
        for name, mod, attr, t in list(_named_tensors(module, kind)):
            new = done.get(id(t))
            if new is None:
                g = _place(t, placement, layouts[name])
                new = nn.Parameter(g, requires_grad=t.requires_grad) if kind == "parameter" else g
                done[id(t)] = new
            if kind == "parameter":
                mod._parameters[attr] = new
            else:
                mod._buffers[attr] = new
    install_activation_layouts(module, placement, activations, strict)
    if bucket_bytes:
        bucket_gradients(module, bucket_bytes)
    return module


def full_state_dict(module_or_state: Union[nn.Module, Mapping[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """A state dict of plain tensors: every global tensor gathered whole (on every rank), e.g. to save
    a checkpoint or to load into a single-device module."""
    state = module_or_state.state_dict() if isinstance(module_or_state, nn.Module) else module_or_state
    return {k: (v.full_tensor().detach() if isinstance(v, GlobalTensor) else v) for k, v in state.items()}
