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

:class:`ZeroOptimizer` is itself a ``torch.optim.Optimizer`` over the model's parameters, so
LR schedulers, step hooks, ``add_param_group`` and ``state_dict`` work as with any optimizer.
The wrapped optimizer keeps no groups or state of its own: it steps over the
:class:`ZeroOptimizer`'s, with each parameter stood in for by its shard.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterable, Iterator, Optional

import torch

from ..sbp import blocks_problem, split
from ..tensor import GlobalTensor

_raw_grad = torch._C.TensorBase.grad   # the accumulated gradient as autograd stored it (no boxing)


def shard_sbp(t: GlobalTensor, axis: int) -> tuple:
    """The nd-SBP of ``t``'s optimizer shard: broadcast on ``axis`` becomes a split of the largest dim
    no other axis splits (else of the largest dim); other axes keep their SBP. 0-dim tensors stay,
    and so does a tensor whose only dims to cut are blocked in a way a plain split cannot join
    (``S(0, blocks=3)`` on another axis, cut over 2 ranks here)."""
    nd = tuple(t.sbp)
    if not nd[axis].is_broadcast or t.dim() == 0:
        return nd
    taken = {v.dim for a, v in enumerate(nd) if a != axis and v.is_split}
    free = [d for d in range(t.dim()) if d not in taken] or list(range(t.dim()))
    d = max(free, key=lambda k: (t.shape[k], -k))
    sharded = tuple(split(d) if a == axis else v for a, v in enumerate(nd))
    return nd if blocks_problem(tuple(t.shape), t.placement.hierarchy, sharded) else sharded


class _ShardState(dict):
    """The optimizer state, keyed by parameter as in any ``torch.optim`` optimizer (a missing entry
    starts empty); a shard as key reads its parameter's entry, which is how the wrapped optimizer,
    stepping over the shards, finds it."""

    def __init__(self, param_of: Dict[GlobalTensor, torch.Tensor], entries=()):
        super().__init__(entries)
        self._param_of = param_of

    def __missing__(self, key):
        param = self._param_of.get(key)
        return self.setdefault(key, {}) if param is None else self[param]


class ZeroOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer_class`` so that its state and update are sharded over placement axis ``axis``.

        opt = gt.nn.ZeroOptimizer(model.parameters(), torch.optim.AdamW, axis=0, lr=1e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
        loss.backward(); opt.step(); sched.step(); opt.zero_grad()

    ``params`` are global tensors (parameters or param-group dicts, as for any optimizer); the
    keyword arguments go to ``optimizer_class``. It is a ``torch.optim.Optimizer`` over those
    parameters: ``param_groups`` hold them with ``optimizer_class``'s hyperparameters (``defaults``
    are its defaults), and the wrapped optimizer reads these very groups at each step, so an LR
    scheduler's edits take effect at the next step. ``state`` is keyed by parameter (its tensors
    are split over ``axis`` like the parameter's shard; ``state[shard_of(p)]`` is ``state[p]``), so
    ``state_dict`` and ``load_state_dict`` round-trip as usual, with global tensors inside.
    ``add_param_group``, step hooks, ``step(closure)`` and ``copy.deepcopy`` work as for any
    optimizer. Each step starts from the parameters as they are then, so writing them between
    steps (``module.load_state_dict`` after the optimizer was made) counts.
    """

    def __init__(self, params: Iterable, optimizer_class, *, axis: int = 0, **defaults):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"ZeroOptimizer: optimizer_class must be a torch.optim.Optimizer subclass, "
                            f"got {optimizer_class!r}")
        self.axis = axis
        self._shards: Dict[torch.Tensor, GlobalTensor] = {}
        self._param_of: Dict[GlobalTensor, torch.Tensor] = {}
        super().__init__(params, defaults)
        with self._params_as_shards():     # it checks its arguments and fills its defaults into the groups
            self._optimizer = optimizer_class(self.param_groups, **defaults)
        self.defaults = self._optimizer.defaults
        made = self._optimizer.state           # what it makes at construction (Adagrad's sums)
        self.state = _ShardState(self._param_of, ((self._param_of[s], v) for s, v in made.items()))

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

    def add_param_group(self, param_group: dict) -> None:
        """torch's ``add_param_group`` (its checks, defaults and names), then the new parameters' shards;
        a group with a parameter that cannot be sharded is not added."""
        super().add_param_group(param_group)
        params = self.param_groups[-1]["params"]
        try:
            shards = [self._shard(p) for p in params]
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise
        for p, s in zip(params, shards):
            p._sharded_grad = s.sbp      # its gradient is reduce-scattered to this (grad_buckets.py, _load_shards)
        self._shards.update(zip(params, shards))
        self._param_of.update(zip(shards, params))

    def __getstate__(self) -> dict:
        """torch's (defaults, state, groups) and the sharding, for ``copy.deepcopy`` and pickle."""
        return {**super().__getstate__(), "axis": self.axis, "_optimizer": self._optimizer,
                "_shards": self._shards, "_param_of": self._param_of}

    def __setstate__(self, state: dict) -> None:
        """``load_state_dict`` (and unpickling) set the state through here; it is keyed by parameter
        and must resolve shards again."""
        super().__setstate__(state)
        self.state = _ShardState(self._param_of, self.state)

    def shard_of(self, p) -> Optional[GlobalTensor]:
        """The shard tensor the wrapped optimizer updates for parameter ``p``."""
        return self._shards.get(p)

    @contextmanager
    def _params_as_shards(self) -> Iterator[None]:
        """Within, every group's ``params`` are the parameters' shards: the tensors the wrapped
        optimizer updates."""
        groups = self.param_groups
        params = [group["params"] for group in groups]
        for group in groups:
            group["params"] = [self._shards[p] for p in group["params"]]
        try:
            yield
        finally:
            for group, ps in zip(groups, params):
                group["params"] = ps

    @torch.no_grad()
    def step(self, closure=None):
        """Load the shards (gradients reduce-scattered, values sliced from the parameters), step the
        wrapped optimizer over them with this optimizer's groups and state, all-gather the updated
        shards into the parameters. Returns ``closure()``'s loss (computed first, with gradients
        enabled) or None."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._load_shards()
        with self._params_as_shards():
            # this optimizer's groups and state, as they are now (load_state_dict replaces both)
            self._optimizer.param_groups, self._optimizer.state = self.param_groups, self.state
            self._optimizer.step()
        for p, s in self._shards.items():
            if s.grad is not None:
                p.copy_(s)                           # all-gather the updated shards
        return loss

    def _load_shards(self) -> None:
        """Give each shard its parameter's gradient, reduce-scattered over the data axis, and its
        parameter's values (a slice, local unless the shard splits a dim the parameter already
        splits): the parameter may have been written since the last step, by
        ``module.load_state_dict`` say."""
        for p, s in self._shards.items():
            g = _raw_grad.__get__(p)
            if g is None:
                s.grad = None
                continue
            if not isinstance(g, GlobalTensor):
                raise TypeError(f"ZeroOptimizer: a parameter of shape {tuple(p.shape)} has a plain (local) "
                                f"gradient; expected a global one")
            s.grad = g.to_global(sbp=s.sbp)
            s.copy_(p)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' gradients (set to None, or zeroed in place) as stored, without first
        reducing a partial one as reading ``.grad`` would; the shards' gradients are internal and
        always dropped."""
        with torch.no_grad():
            for p, s in self._shards.items():
                s.grad = None
                g = _raw_grad.__get__(p)
                if g is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    g.zero_()

    def __repr__(self) -> str:
        """torch's listing of the groups, headed by the wrapped class and the axis."""
        name = type(self).__name__
        return f"{name}({type(self._optimizer).__name__}, axis={self.axis}){super().__repr__()[len(name):]}"
