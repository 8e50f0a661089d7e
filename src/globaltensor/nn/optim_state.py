"""``init_optimizer_state``: give a fresh optimizer the state tensors a checkpoint loads into.

``torch.distributed.checkpoint.load`` fills the tensors of the state dict it is given, in
place; a new optimizer has no state yet (Adam makes its moments at the first step), so there
is nothing to fill. One step with zero gradients and a zero learning rate creates every state
tensor in its layout (a :class:`ZeroOptimizer`'s are split like the parameters' shards) and
leaves the parameters as they are; the load then overwrites the state, step counts included.
"""
from __future__ import annotations

import torch

_raw_grad = torch._C.TensorBase.grad


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Create ``optimizer``'s per-parameter state (as its first step would) without changing any
    parameter, so that ``optimizer.state_dict()`` holds the tensors ``dcp.load`` fills. An
    optimizer that already has state, or parameters with gradients, is left alone. Returns it."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"init_optimizer_state: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if optimizer.state or any(_raw_grad.__get__(p) is not None for p in params):
        return optimizer
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    lrs = [group.get("lr") for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    try:
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs):
            if "lr" in group:
                group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
    return optimizer
