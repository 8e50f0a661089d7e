"""The first stage of a decision: which path an op takes, from the op, its record and the shape of
its arguments -- before any candidate signature is looked at.

- ``inplace_view``: an in-place op that changes only metadata (``transpose_``), run as its
  out-of-place view op (writes/metadata_ops.py);
- ``scalar_read``: ``aten._local_scalar_dense`` (``bool(x)``, ``float(x)``), a collective read;
- ``list``: ``_foreach_*``, the fused optimizers, GradScaler's unscale (decide/lists.py);
- ``decompose``: no rule, but a decomposition into ops that are dispatched again;
- ``fallback``: no rule and no decomposition, a tensor nested deeper than one list, an output
  whose meta cannot be computed or is not tensors: gathered to broadcast (fallback.py);
- ``align``: global inputs on several placements, all but one placement's 0-dim: those brought
  to it, and the op dispatched again (align_placements.py);
- ``rule``: the op's SBP rule chooses a signature (decide/candidates.py, decide/cost.py).

A ``rule`` route carries what the later stages need: the rule, where the tensors sit, the
tensors, their meta stand-ins, the output meta and the placement.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch._decomp import decomposition_table

from ...placement import Placement
from ...tensor import GlobalTensor
from ..align_placements import aligned_placement
from ..fallback import reject_other_layouts
from ..registry import Rule, find_rule
from ..scalar_read import SCALAR_READS
from ..schema.args import Substitution, get, tensor_positions
from ..schema.op_record import record
from ..schema.out_meta import output_meta
from ..schema.written_args import check_writes_kept
from .lists import list_kind


@dataclass
class Route:
    kind: str                                   # one of the module docstring's
    func: object
    list_kind: Optional[str] = None             # "foreach" | "fused" | "unscale" for a list op
    decomposition: Optional[Callable] = None
    rule: Optional[Rule] = None
    positions: Optional[list] = None            # where the tensors sit (schema/args.py)
    tensors: Optional[list] = None
    meta_args: tuple = ()
    meta_kwargs: Optional[dict] = None
    meta_out: object = None                     # the output on meta tensors of the global shapes
    out_kind: str = "tensor"                    # "tensor" | "tuple" | "list" | "none"
    placement: Optional[Placement] = None


def route(func, args: tuple, kwargs: dict) -> Route:
    """The path ``func`` takes on these arguments."""
    rec = record(func)
    if rec.inplace_view:
        return Route("inplace_view", func)
    if func in SCALAR_READS:
        return Route("scalar_read", func)
    check_writes_kept(func)
    rule = find_rule(func)
    if rule is None:
        kind = list_kind(func)
        if kind is not None:
            return Route("list", func, list_kind=kind)
        decomposed = decomposition_table.get(func) or _composite(func)
        return Route("decompose", func, decomposition=decomposed) if decomposed is not None else Route("fallback", func)
    positions = tensor_positions(args, kwargs)
    if positions is None:
        return Route("fallback", func)
    tensors = [get(args, kwargs, p) for p in positions]
    target = aligned_placement(func, tensors)
    if target is not None:
        return Route("align", func, placement=target)
    reject_other_layouts(func, tensors)
    meta_args, meta_kwargs = Substitution(positions)(args, kwargs, [_meta(t) for t in tensors])
    try:
        meta_out = output_meta(func, meta_args, meta_kwargs)
    except Exception:
        return Route("fallback", func)
    out_kind = _out_kind(meta_out)
    if out_kind == "other":
        return Route("fallback", func)
    placement = _placement_of(tensors)
    if rule.out_meta is not None:
        meta_out = rule.out_meta(meta_out, placement.type, *meta_args, **meta_kwargs)
    return Route("rule", func, rule=rule, positions=positions, tensors=tensors, meta_args=tuple(meta_args),
                 meta_kwargs=meta_kwargs, meta_out=meta_out, out_kind=out_kind, placement=placement)


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


def _placement_of(tensors) -> Placement:
    """The placement the global inputs share (aligned_placement has dealt with any other case)."""
    return next(v.placement for v in tensors if isinstance(v, GlobalTensor))


def _composite(func) -> Optional[Callable]:
    """The op's CompositeImplicitAutograd kernel, which calls other ops, when it has one.

    Such ops (``log_sigmoid``, ``narrow``, ``flatten``, ``matmul``, ``__or__``, ...) are normally
    taken apart above autograd and never reach a tensor subclass; they do reach it from inside a
    Python decomposition, which runs below autograd (``binary_cross_entropy_with_logits``,
    ``glu``, the backward of ``hardtanh``)."""
    if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
        return func.decompose
    return None
