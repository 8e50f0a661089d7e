"""``gt.nn.auto_plan``: choose every parameter's SBP and the inputs' from the cost model, and say why.

    plan = gt.nn.auto_plan(model, placement, (idx, targets), step=lambda m, i, t: m.loss(i, t).backward(),
                           memory_limit=2 * 2**30, optimizer=torch.optim.AdamW)
    print(plan.explain())
    gt.nn.distribute_module(model, placement, plan)                  # the plan is a plan
    idx, targets = (gt.distribute(a, placement, sbp) for a, sbp in zip((idx, targets), plan.inputs))
    opt = plan.optimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)   # ZeroOptimizer where it chose ZeRO
    print(plan.predict().table())          # step time, tokens/s, MFU, peak memory per rank, where the time goes

The search (candidates.py) gives each placement axis a role -- data, tensor (Megatron pairs read
off the modules, fused layers as blocked splits), FSDP, sequence -- with or without ZeRO's split
optimizer state and a vocabulary-parallel head; it runs the step once per candidate through the
dispatcher on meta pieces (cost.py: every op's signature chosen by its rule as in a real run,
every collective counted, every kernel's flops or bytes tallied per rank) and keeps the candidate of
least predicted step time (predict.py: compute, communication and host dispatch, on this machine as
``gt.calibrate()`` measured it -- or its defaults -- or on a named ``device``) whose memory per rank
-- parameters, gradients, optimizer state, peak activations -- fits ``memory_limit`` (for a named
device, by default, its memory). Ties go to fewer bytes, then to the earlier candidate (data
parallel first). The plan serves eager and compiled
steps alike. Plans are cached by the model's structure, the placement, the arguments' meta, the
step, the limit and the calibration.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .calibration import current_calibration
from ...comm import get_world
from ...placement import Placement
from ...sbp import broadcast, nd_from_list, nd_to_list
from ...tensor import GlobalTensor
from .candidates import Candidate, candidates, input_layout, is_linear, parameter_layouts
from .cost import Cost, NeedsHostReads, evaluate, record_host_reads
from .devices import Device, device_named
from .explain import explain
from .predict import Prediction, predict_cost
from ..zero import ZeroOptimizer

#: optimizer state per parameter element, in parameters' worth: Adam and its kin keep two moments
STATE_FACTORS = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adagrad": 1, "RMSprop": 1,
                 "SGD": 1, "Adadelta": 2}
_CACHE: Dict[tuple, "AutoPlan"] = {}


def default_step(model: nn.Module, *args) -> None:
    """The model's output (its first floating tensor) summed, and the backward of that."""
    out = model(*args)
    first = out if isinstance(out, torch.Tensor) else next(
        t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point())
    first.sum().backward()


@dataclass
class Option:
    """One costed candidate: its layouts and what a step costs with them."""
    candidate: Candidate
    params: Dict[str, tuple]
    buffers: Dict[str, tuple]
    inputs: List[tuple]
    cost: Cost

    def to_dict(self) -> dict:
        return {"name": self.candidate.name, "roles": list(self.candidate.roles), "zero": self.candidate.zero,
                "vocab": self.candidate.vocab, "blocked": self.candidate.blocked,
                "balanced": self.candidate.balanced, "params": {k: nd_to_list(v) for k, v in self.params.items()},
                "buffers": {k: nd_to_list(v) for k, v in self.buffers.items()},
                "inputs": [nd_to_list(v) for v in self.inputs],
                "cost": {"bytes": self.cost.bytes, "collectives": self.cost.collectives,
                         "seconds": self.cost.seconds, "memory": self.cost.memory,
                         "memory_parts": dict(self.cost.memory_parts)}}


class AutoPlan(Mapping):
    """The chosen layouts: a mapping ``{parameter or buffer name: nd-SBP}`` that ``distribute_module``
    takes as its plan, ``inputs`` (each example argument's nd-SBP, as ``gt.distribute`` takes it),
    ``zero_axis`` (the data axis to split the optimizer state over, or None), the chosen option's
    ``cost`` and every costed ``options``."""

    def __init__(self, placement: Placement, chosen: Option, options: List[Option], memory_limit: Optional[int],
                 device: Optional[Device] = None, tokens: Optional[int] = None, dtype: torch.dtype = torch.float32):
        self.placement, self.chosen, self.options, self.memory_limit = placement, chosen, options, memory_limit
        self.device, self.tokens, self.dtype = device, tokens, dtype
        self._layouts = {**chosen.buffers, **chosen.params}

    # -- the plan, as distribute_module reads it ----------------------------------------------
    def __getitem__(self, name: str) -> tuple:
        return self._layouts[name]

    def __iter__(self):
        return iter(self._layouts)

    def __len__(self) -> int:
        return len(self._layouts)

    @property
    def inputs(self) -> List[tuple]:
        return list(self.chosen.inputs)

    @property
    def zero_axis(self) -> Optional[int]:
        return self.chosen.candidate.roles.index("data") if self.chosen.candidate.zero else None

    @property
    def expert_axis(self) -> Optional[int]:
        """The placement axis of the chosen plan's expert parallelism, or None: after
        ``distribute_module``, ``gt.nn.expert_parallel(model, placement, axis=plan.expert_axis)``."""
        return self.chosen.candidate.expert_axis

    @property
    def cost(self) -> Cost:
        return self.chosen.cost

    def optimizer(self, params, optimizer_class, **kwargs) -> torch.optim.Optimizer:
        """The optimizer the plan was costed with: ``optimizer_class`` over ``params``, wrapped in a
        ``ZeroOptimizer`` over :attr:`zero_axis` where the plan splits the optimizer state."""
        if self.zero_axis is None:
            return optimizer_class(params, **kwargs)
        return ZeroOptimizer(params, optimizer_class, axis=self.zero_axis, **kwargs)

    # -- prediction -------------------------------------------------------------------------
    def predict(self, device=None, option: Optional[Option] = None, tokens: Optional[int] = None) -> Prediction:
        """The chosen layout's (or ``option``'s) predicted step: time, tokens/s, MFU, peak memory per
        rank, and where the time goes. ``device``: a Device or a name ("H100", "H200", "A100"); None:
        the device the plan was made for (this machine, as ``gt.calibrate()`` measured it, unless
        ``auto_plan(device=)`` named one). ``tokens``: a step's tokens (default: the elements of the
        first integer example argument, the token ids)."""
        option = option or self.chosen
        if option.cost.tally is None:
            raise ValueError("AutoPlan.predict: this plan was loaded with from_dict, which keeps the costs but not "
                             "the tallies a prediction is made from; plan again with auto_plan")
        cal = current_calibration()
        target = device_named(device) or self.device or cal.device
        flops = self.options[0].cost.tally.model_flops          # data parallel's, summed: one device's
        return predict_cost(option.cost, self.placement.rank_list(), target, cal.host,
                            tokens if tokens is not None else self.tokens, flops, self.dtype)

    # -- explanation ------------------------------------------------------------------------
    def explain(self) -> str:
        """Per module: its parameters' SBPs and the bytes and collectives it costs forward and backward;
        then memory per rank, and the best alternatives beside the choice."""
        return explain(self)

    def __repr__(self) -> str:
        c = self.cost
        return (f"AutoPlan({self.chosen.candidate.name} on {self.placement}: {c.bytes:,} bytes and "
                f"{c.collectives} collectives a step, {c.memory:,} bytes per rank)")

    # -- round trip -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"placement": {"type": self.placement.type, "ranks": self.placement.ranks.tolist()},
                "memory_limit": self.memory_limit,
                "chosen": next(i for i, o in enumerate(self.options) if o is self.chosen),
                "options": [o.to_dict() for o in self.options]}

    @classmethod
    def from_dict(cls, data: dict) -> "AutoPlan":
        """The plan :meth:`to_dict` wrote: its layouts, inputs and costs (not the single collectives
        behind the costs, so ``explain()``'s per-module columns of a loaded plan are empty)."""
        placement = Placement(data["placement"]["type"], data["placement"]["ranks"])
        options = [_option_from_dict(o) for o in data["options"]]
        return cls(placement, options[data["chosen"]], options, data["memory_limit"])


def _option_from_dict(o: dict) -> Option:
    c = o["cost"]
    cost = Cost(c["bytes"], c["collectives"], c["seconds"], c["memory"], dict(c["memory_parts"]))
    return Option(Candidate(tuple(o["roles"]), o["zero"], o["vocab"], o["blocked"], o.get("balanced", False)),
                  {k: nd_from_list(v) for k, v in o["params"].items()},
                  {k: nd_from_list(v) for k, v in o["buffers"].items()},
                  [nd_from_list(v) for v in o["inputs"]], cost)


# -- the search ---------------------------------------------------------------------------------

def auto_plan(model: nn.Module, placement: Placement, example_args: Sequence, *, step: Optional[Callable] = None,
              memory_limit: Optional[int] = None, optimizer=None, device=None) -> AutoPlan:
    """Choose each parameter's and input's SBP for ``model`` on ``placement`` (see the module's docstring).

    ``example_args``: the step's arguments -- plain or global tensors (their shape and dtype count,
    not their layout), or shapes (float32). ``step(model, *args)``: a training step (its forward and
    backward; default: the output summed, backward). ``memory_limit``: bytes per rank for
    parameters, gradients, optimizer state and peak activations. ``optimizer``: the optimizer
    class the step uses (its state's size; default Adam's two moments). ``device``: the device the
    job will run on, a Device or a name ("H100", "H200", "A100"; its memory the default limit);
    None: this machine, as ``gt.calibrate()`` measured it."""
    _check(model, placement, example_args, step, memory_limit)
    step = step or default_step
    target = device_named(device)
    if memory_limit is None and target is not None:
        memory_limit = target.memory
    args = [_arg_meta(a) for a in example_args]
    factor = state_factor(optimizer)
    cal = current_calibration()
    key = (_structure(model), placement, tuple(args), step, memory_limit, factor, repr(target), repr(cal))
    plan = _CACHE.get(key)
    if plan is not None:
        return plan
    world_size = get_world().size
    tensors = dict(model.named_parameters())
    buffers = {n: (broadcast,) * placement.ndim for n, _ in model.named_buffers()}
    sequence = any(len(shape) >= 2 for shape, _ in args)

    reads: list = []             # [the host reads of a real step], once a meta run needs them

    def cost_of(candidate: Candidate, order: Dict[str, int]) -> Option:
        params = parameter_layouts(model, candidate, tensors, placement.hierarchy, order)
        inputs = [input_layout(torch.empty(shape, device="meta"), candidate.roles, candidate.balanced)
                  for shape, _ in args]
        zero_axis = candidate.roles.index("data") if candidate.zero else None

        def run():
            return evaluate(model, placement, world_size, params, buffers,
                            [(shape, dtype, nd) for (shape, dtype), nd in zip(args, inputs)], step, zero_axis,
                            factor, cal, candidate.expert_axis, reads[0] if reads else None, target)
        try:
            cost = run()
        except NeedsHostReads as needed:
            if reads:
                raise
            reads.append(_real_reads(model, step, example_args, needed.where))
            cost = run()
        return Option(candidate, params, buffers, inputs, cost)

    replicated = Candidate(("data",) * placement.ndim)
    order: Dict[str, int] = {}
    with _call_order(model, order):               # the first run also tells the order the step runs layers in
        options = [cost_of(replicated, order)]
    options += [cost_of(c, order) for c in candidates(model, placement.ndim, sequence, order) if c != replicated]
    fitting = [o for o in options if memory_limit is None or o.cost.memory <= memory_limit]
    if not fitting:
        least = min(options, key=lambda o: o.cost.memory)
        raise ValueError(f"auto_plan(memory_limit=): no layout fits {memory_limit:,} bytes per rank; the smallest, "
                         f"{least.candidate.name}, needs {least.cost.memory:,} ({_parts(least.cost)})")
    chosen = min(fitting, key=lambda o: (o.cost.seconds, o.cost.bytes, options.index(o)))
    if "sequence" in chosen.candidate.roles:
        twin = cost_of(replace(chosen.candidate, balanced=True), order)
        options.append(twin)
        chosen = balanced_or(chosen, twin, memory_limit)
    tokens = next((math.prod(shape) for shape, dtype in args if not dtype.is_floating_point), None)
    dtype = next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)
    plan = _CACHE[key] = AutoPlan(placement, chosen, options, memory_limit, target, tokens, dtype)
    return plan


BALANCED_SLACK = 0.01


def balanced_or(chosen, twin, memory_limit):
    """The chosen plain sequence split's balanced twin (the same roles, head-tail) where it fits and
    models at most ``BALANCED_SLACK`` more time, else ``chosen``. The modelled time counts
    communication only; under a causal mask the plain split gives the last rank several times the
    first's attention work, which a few bytes' difference (where a scalar's all-reduce lands) does not
    outweigh. Only the winner's twin is costed (a twin per sequence candidate doubled them)."""
    fits = memory_limit is None or twin.cost.memory <= memory_limit
    return twin if fits and twin.cost.seconds <= chosen.cost.seconds * (1 + BALANCED_SLACK) else chosen


@contextmanager
def _call_order(model: nn.Module, order: Dict[str, int]) -> Iterator[None]:
    """Within, ``order`` fills with each linear-like module's name and the position of its first call."""
    def hook(name):
        def note(module, args) -> None:                  # a pre-hook returning a value would replace the args
            order.setdefault(name, len(order))
        return note
    handles = [m.register_forward_pre_hook(hook(name)) for name, m in model.named_modules() if is_linear(m)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _parts(cost: Cost) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in cost.memory_parts.items())


def _check(model, placement, example_args, step, memory_limit) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"auto_plan(model): expected an nn.Module, got {type(model).__name__}")
    if not isinstance(placement, Placement):
        raise TypeError(f"auto_plan(placement): expected a globaltensor placement, got {placement!r}")
    if not isinstance(example_args, (list, tuple)):
        raise TypeError(f"auto_plan(example_args): expected a tuple of tensors or shapes, got {example_args!r}")
    if step is not None and not callable(step):
        raise TypeError(f"auto_plan(step=): expected a function step(model, *args), got {step!r}")
    if memory_limit is not None and (not isinstance(memory_limit, int) or memory_limit <= 0):
        raise ValueError(f"auto_plan(memory_limit=): expected a positive number of bytes, got {memory_limit!r}")


def _real_reads(model: nn.Module, step: Callable, example_args: Sequence, where: str) -> list:
    """The host reads of one real step on the example tensors; ValueError naming the user's line where
    the examples are shapes, which hold no values to read."""
    if not all(isinstance(a, torch.Tensor) for a in example_args):
        raise ValueError(f"auto_plan: the step reads a tensor's value on the host at {where}; give example_args "
                         f"as tensors with real values (the batch it will train on), not shapes, so that one real "
                         f"step can answer such reads")
    plain = [a.full_tensor() if isinstance(a, GlobalTensor) else a for a in example_args]
    return record_host_reads(model, step, plain)


def _arg_meta(a) -> tuple:
    """``(shape, dtype)`` of an example argument."""
    if isinstance(a, torch.Tensor):
        return tuple(a.shape), a.dtype
    if isinstance(a, (tuple, list, torch.Size)) and all(isinstance(s, int) for s in a):
        return tuple(a), torch.float32
    raise TypeError(f"auto_plan(example_args): expected tensors or shapes (tuples of ints), got {a!r}")


def state_factor(optimizer) -> int:
    """The optimizer state per parameter element, in parameters' worth, of an optimizer class (or
    instance); Adam's two moments for None or a class the table does not know."""
    if optimizer is None:
        return 2
    name = optimizer.__name__ if isinstance(optimizer, type) else type(optimizer).__name__
    return STATE_FACTORS.get(name, 2)


def _structure(model: nn.Module) -> tuple:
    """The model's structure: module types by name, parameter and buffer shapes and dtypes."""
    return (tuple((n, type(m).__name__) for n, m in model.named_modules()),
            tuple((n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in model.named_parameters()),
            tuple((n, tuple(t.shape), t.dtype) for n, t in model.named_buffers()))

