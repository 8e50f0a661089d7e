"""ZeRO-style sharding of the optimizer over a data-parallel axis.

In data parallelism every rank of the data axis holds the whole parameter (``B`` on that
axis) and, with a plain optimizer, the whole optimizer state, and applies the same update
as every other rank. :class:`ZeroOptimizer` keeps the parameters replicated for the forward
and backward passes but gives each rank only its slice of the update:

1. the accumulated gradient -- a partial sum over the data axis when the batch is split
   there -- is reduce-scattered straight to a shard layout, ``S(d)`` on the data axis
   (instead of all-reduced to ``B``);
2. the wrapped optimizer (any ``torch.optim`` class) updates a shard of each parameter, so
   its state (momentum, Adam's moments) is split over the data axis too: each rank holds
   1/n of it;
3. the updated shards are all-gathered back into the replicated parameters.

Reduce-scatter plus all-gather move the same bytes as the all-reduce they replace; the
optimizer's memory and compute are divided by the data axis's size (ZeRO stage 1/2).
"""
from __future__ import annotations

from typing import Iterable, List, Optional

import torch

from ..sbp import split
from ..tensor import GlobalTensor

_raw_grad = torch._C.TensorBase.grad   # the accumulated gradient as autograd stored it (no boxing)


def shard_sbp(t: GlobalTensor, axis: int) -> tuple:
    """The nd-SBP of ``t``'s optimizer shard: broadcast on ``axis`` becomes a split of the largest dim
    no other axis splits (else of the largest dim); other axes keep their SBP. 0-dim tensors stay."""
    nd = tuple(t.sbp)
    if not nd[axis].is_broadcast or t.dim() == 0:
        return nd
    taken = {v.dim for a, v in enumerate(nd) if a != axis and v.is_split}
    free = [d for d in range(t.dim()) if d not in taken] or list(range(t.dim()))
    d = max(free, key=lambda k: (t.shape[k], -k))
    return tuple(split(d) if a == axis else v for a, v in enumerate(nd))


class ZeroOptimizer:
    """Wrap ``optimizer_class`` so that its state and update are sharded over placement axis ``axis``.

        opt = gt.nn.ZeroOptimizer(model.parameters(), torch.optim.AdamW, axis=0, lr=1e-3)
        loss.backward(); opt.step(); opt.zero_grad()

    ``params`` are global tensors (parameters or param-group dicts, as for any optimizer); the
    keyword arguments go to ``optimizer_class``. ``param_groups``, ``state``, ``state_dict`` and
    ``load_state_dict`` are the wrapped optimizer's, over the shards.
    """

    def __init__(self, params: Iterable, optimizer_class, *, axis: int = 0, **defaults):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"ZeroOptimizer: optimizer_class must be a torch.optim.Optimizer subclass, "
                            f"got {optimizer_class!r}")
        groups = list(params)
        if not groups:
            raise ValueError("ZeroOptimizer: got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.axis = axis
        self._pairs: List[tuple] = []
        shard_groups = []
        for group in groups:
            params_of = group["params"]
            params_of = [params_of] if isinstance(params_of, torch.Tensor) else list(params_of)
            shards = [self._shard(p) for p in params_of]
            self._pairs.extend(zip(params_of, shards))
            shard_groups.append({**group, "params": shards})
        self.optimizer = optimizer_class(shard_groups, **defaults)

    def _shard(self, p) -> GlobalTensor:
        if not isinstance(p, GlobalTensor):
            raise TypeError(f"ZeroOptimizer: expected global parameters (see gt.nn.distribute_module), got a "
                            f"{type(p).__name__} of shape {tuple(p.shape)}")
        if not isinstance(self.axis, int) or not 0 <= self.axis < p.placement.ndim:
            raise ValueError(f"ZeroOptimizer(axis=): expected a placement axis in 0..{p.placement.ndim - 1} "
                             f"for a parameter on {p.placement}, got {self.axis!r}")
        if any(v.is_partial for v in p.sbp):
            raise ValueError(f"ZeroOptimizer: a parameter of shape {tuple(p.shape)} has sbp {p.sbp}; parameters "
                             f"must be split or broadcast, not partial_sum")
        with torch.no_grad():
            shard = p.detach().to_global(sbp=shard_sbp(p, self.axis)).clone()
        return shard.requires_grad_(p.requires_grad)

    # -- the optimizer interface ----------------------------------------------------------------
    @property
    def param_groups(self) -> list:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def shard_of(self, p) -> Optional[GlobalTensor]:
        """The shard tensor the wrapped optimizer updates for parameter ``p``."""
        return next((s for q, s in self._pairs if q is p), None)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for p, s in self._pairs:
            g = _raw_grad.__get__(p)
            if g is None:
                s.grad = None
                continue
            if not isinstance(g, GlobalTensor):
                raise TypeError(f"ZeroOptimizer: a parameter of shape {tuple(p.shape)} has a plain (local) "
                                f"gradient; expected a global one")
            s.grad = g.to_global(sbp=s.sbp)          # reduce-scatter over the data axis
        self.optimizer.step()
        for p, s in self._pairs:
            if s.grad is not None:
                p.copy_(s)                           # all-gather the updated shards
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' gradients (set to None, or zeroed in place); the shards' gradients are
        internal and always dropped."""
        with torch.no_grad():
            for p, s in self._pairs:
                s.grad = None
                g = _raw_grad.__get__(p)
                if g is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    g.zero_()

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"ZeroOptimizer(axis={self.axis}, {self.optimizer!r})"
