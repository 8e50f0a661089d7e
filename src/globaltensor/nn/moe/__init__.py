"""Expert parallelism: a MoE model's tokens move to the ranks of their experts, the experts' weights stay.

    gt.nn.distribute_module(model, placement, {"*.experts.gate_up_proj": S(0), "*.experts.down_proj": S(0)})
    gt.nn.expert_parallel(model, placement, axis=0)

Experts held as an ``nn.ModuleList`` need no plan entry: ``expert_parallel`` places each expert's
module on the ranks that own it.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Optional, Tuple

import torch

from ...placement import Placement
from ...sbp import Split, broadcast
from ...tensor import GlobalTensor, check_placement
from ..distribute import distribute_module
from .experts import Listed, Routed, find_experts, owner_placement, unusable_expert_lists, weight_of
from .forward import expert_parallel_forward, routed_forward


def expert_parallel(model: torch.nn.Module, placement: Placement, axis: int = 0, *,
                    capacity_factor: Optional[float] = None) -> torch.nn.Module:
    """Make every MoE experts module of ``model`` dispatch its tokens to its experts' ranks.

    The experts' stacked weights must already lie split on their expert dim over placement axis
    ``axis`` (and broadcast on the others), by ``gt.nn.distribute_module``; each experts module's
    forward is then replaced, on the instance, by the all-to-all dispatch (``nn/moe/forward.py``).
    Recognises HuggingFace transformers' experts modules (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3
    and the other users of ``transformers.integrations.moe``), torchtitan's ``RoutedExperts`` (its
    MoE layers': ``inner_experts.w1_EFD`` / ``w2_EDF`` / ``w3_EFD``), and any module with HF's experts
    interface (``forward(hidden_states, top_k_index, top_k_weights)``) holding its experts in an
    ``nn.ModuleList`` named ``experts``: expert ``e``'s module is moved, whole and broadcast, to the
    ranks of the axis member that owns it (``nn/moe/experts.py``) -- build the optimizer after this
    call. ``capacity_factor``: each rank sends
    each expert ``ceil(capacity_factor x its rows / experts)`` rows, padded, so that the sizes are
    fixed (what ``gt.compile`` needs; ``nn/moe/padded.py``); a step routing more raises. Without it
    the sizes follow the routing exactly. Returns ``model``.
    """
    placement = check_placement(placement)
    if not isinstance(axis, int) or not 0 <= axis < placement.ndim:
        raise ValueError(f"expert_parallel(axis): expected a placement axis in 0..{placement.ndim - 1}, got {axis!r}")
    if capacity_factor is not None and (isinstance(capacity_factor, bool) or
                                        not isinstance(capacity_factor, (int, float)) or capacity_factor <= 0):
        raise ValueError(f"expert_parallel(capacity_factor): expected a positive number or None, got "
                         f"{capacity_factor!r}")
    found = find_experts(model)
    if not found:
        lists = unusable_expert_lists(model)
        why = f"; {lists[0]} is an nn.ModuleList of experts, but its owner's forward does not take (hidden_states, " \
              f"top_k_index, top_k_weights): move the routing out of the module that loops over its experts" \
            if lists else ""
        raise ValueError(f"expert_parallel: no MoE experts module in {type(model).__name__}; expected HuggingFace "
                         f"transformers' experts (3-D gate_up_proj or up_proj and down_proj, num_experts on dim 0), "
                         f"torchtitan's RoutedExperts (inner_experts with 3-D w1_EFD, w2_EDF, w3_EFD) or a module "
                         f"whose forward takes (hidden_states, top_k_index, top_k_weights) and holds its experts in "
                         f"an nn.ModuleList named experts{why}")
    for name, module, kind in found:
        if isinstance(kind, Listed):
            _place_listed(module, kind, placement, axis)
        tensor_axes = _tensor_axes(name, module, kind, placement, axis)
        forward = routed_forward if isinstance(kind, Routed) else expert_parallel_forward
        module.forward = functools.partial(forward, module, kind, placement, axis, tensor_axes, name, capacity_factor)
    return model


@contextlib.contextmanager
def expert_parallel_applied(model: torch.nn.Module, placement: Placement, axis: int) -> Iterator[None]:
    """:func:`expert_parallel` while inside (a plan's costing); each experts module's forward as it was after."""
    previous = [(m, m.__dict__.get("forward")) for _, m, _ in find_experts(model)]
    expert_parallel(model, placement, axis)
    try:
        yield
    finally:
        for m, forward in previous:
            if forward is None:
                del m.forward
            else:
                m.forward = forward


def _place_listed(module, kind: Listed, placement: Placement, axis: int) -> None:
    """Each expert's parameters and buffers whole on its owners' ranks, broadcast (a gradient partial
    over a data axis there is reduced when read)."""
    for e, expert in enumerate(module.experts):
        distribute_module(expert, owner_placement(placement, axis, kind.num_experts, e), bucket_bytes=0)


def _tensor_axes(name: str, module, kind, placement: Placement, axis: int) -> Tuple[int, ...]:
    """Check the experts' weights' layouts; the placement axes that split every expert Megatron's way
    (tensor-parallel experts: a partial result to be summed over the axis), the others broadcast."""
    weights = {w: weight_of(module, w) for w in kind.weights}
    for w, t in weights.items():
        if not isinstance(t, GlobalTensor):
            raise ValueError(f"expert_parallel: {name}.{w} is not a global tensor; lay the model out first, its experts "
                             f"split on dim 0 over axis {axis}: gt.nn.distribute_module(model, placement, "
                             f"{{'*.{name.rsplit('.', 1)[-1]}.{w}': ...}})")
    tensor_axes = []
    for a in range(placement.ndim):
        tensor = a != axis and any(not t.sbp[a].is_broadcast for t in weights.values()) and kind.tensor_parallel
        want = {w: Split(0) if a == axis else (kind.tensor_split(w) if tensor else broadcast) for w in weights}
        for w, t in weights.items():
            if t.placement != placement or t.sbp[a] != want[w]:
                nd = tuple(want[w] if b == a else v for b, v in enumerate(t.sbp)) if t.placement == placement else \
                    "on the placement " + str(placement)
                megatron = f" or, for tensor-parallel experts without biases, split as Megatron splits an MLP (" \
                    f"{', '.join(f'{v}: {kind.tensor_split(v)}' for v in weights)})" if kind.tensor_parallel else ""
                raise ValueError(f"expert_parallel: {name}.{w} is {t.sbp} on {t.placement}; expert parallelism on axis "
                                 f"{axis} needs it {nd}: experts split on dim 0 over that axis, and on each other axis "
                                 f"broadcast{megatron}")
        if tensor:
            tensor_axes.append(a)
    return tuple(tensor_axes)
