"""What one candidate layout costs a training step: run it once through the dispatcher on meta pieces.

The model's parameters and buffers are swapped, for the run only, for global tensors of the
candidate's layouts whose pieces are meta tensors (shapes, no data), on a simulated world of the
placement's size; the step runs (forward and backward: every rule, signature and boxing plan as in a
real run, data-parallel gradients reduced in buckets as ``distribute_module`` sets them up), then the
optimizer's reads -- each gradient boxed to its parameter's layout, or with ZeRO reduce-scattered to
the shard and the updated shards all-gathered. ``gt.comm_profile`` records every collective with
its module and phase. Memory per rank is the parameters and optimizer state of the layouts and the
gradient buckets' flat buffers (a real run keeps them from one backward to the next), plus the
peak of what the step makes alive: the storages of every tensor each rank's ops and collectives
make -- global tensors' pieces, a kernel's temporaries, a collective's results -- each storage
once, from when it is made to when nothing holds it (activations, and gradients outside the
buckets as they appear; a view of a parameter, an input or a bucket is none of them); the parts
give those gradients' bytes and the rest of that peak as activations. Every
kernel each rank runs is tallied with its flops or bytes (compute.py), and the optimizer's update
as memory-bound kernels over the pieces it steps; the step's modelled time is its prediction
(predict.py) on the planning device -- this machine as ``gt.calibrate()`` measured it, or a named
one. A step that reads values on the host (a mask's ``if mask.all():``) has them from one real run
of it on one device, replayed in every meta run.
"""
from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from ...boxing import Layout
from ...comm import set_world
from ...observe import comm_profile
from ...observe.context import current_label, run_labelled
from ...observe.where import user_frame
from ...placement import Placement
from ...ops.schema.op_record import record
from ...tensor import GlobalTensor, observe_creation
from ..grad_buckets import bucket_gradients
from ..moe import expert_parallel_applied
from ..zero import shard_sbp
from .compute import RANK, ComputeTally, TallyingWorld, tag_pieces, tensors_in
from .devices import Device
from .predict import predict_cost


@dataclass
class Cost:
    bytes: int                          # the most any rank sends in the step
    collectives: int
    seconds: float                      # the predicted step on the planning device (predict.py)
    memory: int                         # the most any rank holds: parameters, gradients, state, activations
    memory_parts: Dict[str, int] = field(default_factory=dict)
    events: list = field(default_factory=list, repr=False)      # gt.comm_profile's CommEvents
    tally: Optional[ComputeTally] = field(default=None, repr=False)
    memory_by_rank: Dict[int, int] = field(default_factory=dict, repr=False)


def meta_global(shape, dtype, placement: Placement, nd: tuple, world) -> GlobalTensor:
    layout = Layout(tuple(shape), dtype, placement, nd)
    return GlobalTensor(layout, {r: torch.empty(layout.piece_shape(r), dtype=dtype, device="meta")
                                 for r in placement.rank_list() if world.holds(r)})


@contextlib.contextmanager
def swapped(model: nn.Module, tensors: Dict[int, torch.Tensor]) -> Iterator[None]:
    """Within, every parameter and buffer slot of ``model`` holds ``tensors[id(original)]`` (shared
    tensors stay shared); the originals are back afterwards."""
    slots = [(m, kind, attr, t) for m in model.modules() for kind in ("_parameters", "_buffers")
             for attr, t in getattr(m, kind).items() if t is not None]
    try:
        for m, kind, attr, t in slots:
            getattr(m, kind)[attr] = tensors[id(t)]
        yield
    finally:
        for m, kind, attr, t in slots:
            getattr(m, kind)[attr] = t


#: ops that read a tensor's value on the host (``.item()``, ``bool(x)``, ``torch.equal``)
HOST_READS = frozenset({torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default,
                        torch.ops.aten.is_nonzero.default, torch.ops.aten.item.default})


class NeedsHostReads(Exception):
    """A meta run met a host read (a model's mask code asking whether any position is padded) and has
    no recorded values to answer with: ``where`` is the user's line."""

    def __init__(self, where: str):
        super().__init__(where)
        self.where = where


class HostReads(TorchDispatchMode):
    """Records the value of every host read of a real step on one device: ``values``, ``(op, value)``
    in order. The values do not depend on the layout, so each meta run answers its reads with them
    (:class:`MemoizedMeta`), taking the same branches as the real step."""

    def __init__(self):
        super().__init__()
        self.values: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in HOST_READS:
            self.values.append((func, out))
        return out


def record_host_reads(model: nn.Module, step: Callable, args: list) -> list:
    """The host reads of ``step(model, *args)`` run for real on one device (:class:`HostReads`); the
    model's gradients and buffers (running statistics) are put back as they were."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    for p in params:
        p.grad = None
    try:
        with HostReads() as reads:
            step(model, *args)
    finally:
        for p, g in zip(params, grads):
            p.grad = g
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    return reads.values


class MemoizedMeta(TorchDispatchMode):
    """Keeps every plain tensor of the run on the meta device, and replays the meta kernels of ops on
    meta pieces. A host read takes the next of ``reads`` (a real run's, :func:`record_host_reads`), or
    with none raises :class:`NeedsHostReads`.

    A tensor the library makes on the placement's device (a gradient bucket's buffer, a plain input
    moved to a rank) is made on meta instead: the run has no data anywhere. An op that aliases and
    writes nothing gives the same result metadata for the same arguments' shapes, strides and dtypes,
    and a model's repeated blocks ask the same questions again (torch's Python meta kernels of
    pointwise ops were most of an evaluation's time). Global ops pass through to their own dispatch,
    whose piece ops come back here."""

    def __init__(self, reads: Optional[list] = None, tally: Optional[ComputeTally] = None,
                 world: Optional[TallyingWorld] = None, module: Callable[[], str] = lambda: ""):
        super().__init__()
        self.results: dict = {}
        self.reads = None if reads is None else iter(reads)
        self.tally, self.world, self.module = tally, world, module

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS:
            return self._read(func)
        if any(issubclass(t, GlobalTensor) for t in types):
            if self.tally is not None:
                self.tally.global_op(args, kwargs)
            with self:
                return GlobalTensor.__torch_dispatch__(func, types, args, kwargs)
        if isinstance(kwargs.get("device"), torch.device) and kwargs["device"].type != "meta" or \
                isinstance(kwargs.get("device"), str):
            kwargs = dict(kwargs, device=_META)
        key = self._key(func, args, kwargs)
        out = self._run(func, args, kwargs, key)
        if self.tally is not None and not self.world.busy:
            self.tally.piece_op(func, args, kwargs, out, current_label()[1], self.module(), key)
            live = self.world.live
            for t in tensors_in(out) if live is not None else ():
                if RANK in t.__dict__:
                    live.made(t.__dict__[RANK], t)
        return out

    def _run(self, func, args, kwargs, key):
        if key is None:
            return _meta_call(func, args, kwargs)
        made = self.results.get(key)
        if made is None:
            out = _meta_call(func, args, kwargs)
            made = self.results[key] = tree_map(_metadata, out)
            return out
        return tree_map(_remade, made)

    def _read(self, func):
        if self.reads is None:
            raise NeedsHostReads(user_frame())
        op, value = next(self.reads, (None, None))
        if op is not func:
            raise RuntimeError(f"auto_plan: the step read values on the host in another order than its real run "
                               f"(expected {op}, got {func}) at {user_frame()}; its reads must not depend on the layout")
        return value

    @staticmethod
    def _key(func, args, kwargs):
        if not record(func).aliases_nothing or torch.Tag.nondeterministic_seeded in func.tags:
            return None
        flat = tree_flatten((args, kwargs))[0]
        key = [func]
        for v in flat:
            if isinstance(v, torch.Tensor):
                if not v.is_meta:
                    return None
                key.append((tuple(v.shape), v.stride(), v.dtype))
            elif isinstance(v, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format)):
                key.append(v)
            else:
                return None
        return tuple(key)


_META = torch.device("meta")


def _meta_call(func, args, kwargs):
    """``func`` on meta tensors; where its meta kernel refuses a dtype the device kernels take (the
    grouped matmul's meta check wants bfloat16, its CPU kernel takes float32 too), the shapes are
    asked of it in bfloat16 and the results given back in the arguments' floating dtype. A run on
    meta tensors costs layouts; it need not be stricter than the devices are."""
    try:
        return func(*args, **kwargs)
    except RuntimeError as refused:
        floats = {t.dtype for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.is_meta and t.is_floating_point()}
        if len(floats) != 1 or torch.bfloat16 in floats:
            raise
        dtype = floats.pop()
        as_bf16 = tree_map(lambda t: t.to(torch.bfloat16) if isinstance(t, torch.Tensor) and t.is_meta and
                           t.dtype == dtype else t, (args, kwargs))
        try:
            out = func(*as_bf16[0], **as_bf16[1])
        except RuntimeError:
            raise refused from None
        return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 else t,
                        out)


class _TensorMeta:
    """A result tensor's shape, strides and dtype (a leaf to pytree, unlike a tuple)."""
    __slots__ = ("shape", "stride", "dtype")

    def __init__(self, t: torch.Tensor):
        self.shape, self.stride, self.dtype = tuple(t.shape), t.stride(), t.dtype


def _metadata(v):
    return _TensorMeta(v) if isinstance(v, torch.Tensor) else v


def _remade(v):
    if isinstance(v, _TensorMeta):
        return torch.empty_strided(v.shape, v.stride, dtype=v.dtype, device="meta")
    return v


class LiveBytes:
    """The bytes per rank of the storages of the tensors alive, and their peak: a storage counts once
    however many tensors -- views, aliases, detached twins -- sit on it. :meth:`created` takes a
    global tensor's pieces; :meth:`made` one rank's tensor (a meta run's temporaries and buffers).

    Storages held from one step to the next are :meth:`held`: counted apart (``kept``, per rank),
    never as the step's, so that a view of one -- a weight's transpose before its matmul, a gradient
    in its bucket -- is not counted as memory the step made."""

    def __init__(self):
        self.now: Dict[int, int] = defaultdict(int)
        self.peak: Dict[int, int] = defaultdict(int)
        self.kept: Dict[int, int] = defaultdict(int)
        self._holders: Dict[tuple, int] = {}      # (rank, storage) -> tensors alive on it
        self._sizes: Dict[tuple, int] = {}
        self._held: Dict[tuple, torch.Tensor] = {}   # kept alive: a freed storage's key could be reused

    def created(self, t: GlobalTensor) -> None:
        for r, piece in t._pieces.items():
            self.made(r, piece)

    def held(self, rank: int, t: torch.Tensor, counted: bool = True) -> None:
        """``t``'s storage is held across steps; its bytes go into ``kept`` if ``counted`` (not: the
        caller's -- parameters, counted by their layouts, and inputs, there before the step)."""
        key = (rank, t.untyped_storage()._cdata)
        if key not in self._held:
            self._held[key] = t
            self.kept[rank] += t.untyped_storage().nbytes() if counted else 0

    def made(self, rank: int, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = (rank, storage._cdata)
        if key in self._held:
            return
        if key not in self._holders:
            self._holders[key], self._sizes[key] = 0, storage.nbytes()
            self.now[rank] += self._sizes[key]
            self.peak[rank] = max(self.peak[rank], self.now[rank])
        self._holders[key] += 1
        weakref.finalize(t, self._freed, key)

    def _freed(self, key: tuple) -> None:
        self._holders[key] -= 1
        if not self._holders[key]:
            del self._holders[key]
            self.now[key[0]] -= self._sizes.pop(key)


@contextlib.contextmanager
def observing_creation(*observers: Callable) -> Iterator[None]:
    """Within, every global tensor made is given to each of ``observers``."""
    def created(t: GlobalTensor) -> None:
        for observe in observers:
            observe(t)
    previous = observe_creation(created)
    try:
        yield
    finally:
        observe_creation(previous)


def _per_rank_bytes(layouts: List[Layout], factor: int = 1) -> Dict[int, int]:
    out: Dict[int, int] = defaultdict(int)
    for lay in layouts:
        item = lay.dtype.itemsize
        for r in lay.placement.rank_list():
            n = 1
            for s in lay.piece_shape(r):
                n *= s
            out[r] += n * item * factor
    return out


def evaluate(model: nn.Module, placement: Placement, world_size: int, params: Dict[str, tuple],
             buffers: Dict[str, tuple], args: list, step: Callable, zero_axis, state_factor: int,
             calibration, expert_axis=None, reads: Optional[list] = None, device: Optional[Device] = None) -> Cost:
    """The cost of one step of ``model`` with parameters and buffers laid out on ``placement`` as given
    (``{name: nd-sbp}``), ``args`` as ``[(value or shape, dtype, nd-sbp)]``; ``expert_axis``: the MoE
    experts' tokens sent to their experts over that axis (their routing modelled as even);
    ``reads``: the values the step's host reads take (:func:`record_host_reads`); its time
    predicted on ``device`` (None: this machine, as ``calibration`` measured it)."""
    on = {name: (placement, nd) for name, nd in {**params, **buffers}.items()}
    experts = None if expert_axis is None else (placement, expert_axis)
    return evaluate_layouts(model, world_size, on, [(shape, dtype, placement, nd) for shape, dtype, nd in args],
                            step, zero_axis, state_factor, calibration, experts, reads, device)


def evaluate_layouts(model: nn.Module, world_size: int, layouts: Dict[str, tuple], args: list, step: Callable,
                     zero_axis, state_factor: int, calibration, experts=None, reads: Optional[list] = None,
                     device: Optional[Device] = None, stages: Optional[List[List[int]]] = None) -> Cost:
    """:func:`evaluate` with each parameter and buffer on a placement of its own (``{name: (placement,
    nd-sbp)}``) and ``args`` as ``[(shape, dtype, placement, nd-sbp)]``; ``experts``: ``(placement,
    axis)`` of expert parallelism, or None; ``stages``: the ranks of pipeline stages that run one
    after another (predict.py)."""
    named_params = dict(model.named_parameters())
    named_buffers = dict(model.named_buffers())
    world = TallyingWorld(world_size)
    previous = set_world(world)
    try:
        metas = {}
        param_layouts = {}
        for name, t in named_params.items():
            g = meta_global(t.shape, t.dtype, *layouts[name], world).requires_grad_(t.requires_grad)
            metas[id(t)] = g
            param_layouts[name] = g
        for name, t in named_buffers.items():
            metas[id(t)] = meta_global(t.shape, t.dtype, *layouts[name], world)
        for g in metas.values():
            tag_pieces(g)
        inputs = [meta_global(shape, dtype, placement, nd, world) for shape, dtype, placement, nd in args]
        for g in inputs:
            tag_pieces(g)
        live, tally = LiveBytes(), ComputeTally()
        world.live = live
        for g in [*metas.values(), *inputs]:          # the caller's, held before and after the step
            for r, piece in g._pieces.items():
                live.held(r, piece, counted=False)
        if zero_axis is not None:              # as ZeroOptimizer marks them: buckets reduce-scatter to the shards
            for g in param_layouts.values():
                g._sharded_grad = shard_sbp(g, zero_axis)
        buckets = bucket_gradients([g for g in param_layouts.values() if g.requires_grad])
        buckets.on_new_buffer = live.held            # a real run's buckets stay for the next backward
        buckets.on_bucketed = tally.bucketed_gradient
        try:
            with swapped(model, metas), comm_profile(model) as prof, observing_creation(live.created, tag_pieces), \
                    MemoizedMeta(reads, tally, world, prof.tracker.current), _experts(model, experts):
                step(model, *inputs)
                del inputs
                run_labelled("optimizer step", _optimizer_reads, param_layouts, zero_axis, phase="optimizer")
        finally:
            buckets.close()
        grads = [g.layout_meta for g in param_layouts.values() if g.requires_grad]
        weights = [g.layout_meta for g in param_layouts.values()]
        states = [g.layout_meta if zero_axis is None else
                  g.layout_meta.with_sbp(shard_sbp(g, zero_axis)) for g in param_layouts.values() if g.requires_grad]
    finally:
        set_world(previous)
    _optimizer_update(tally, states, state_factor)
    ranks = sorted({r for placement, _ in layouts.values() for r in placement.rank_list()} |
                   {r for _, _, placement, _ in args for r in placement.rank_list()})
    # ZeroOptimizer keeps, beside the state, each parameter's shard: one more shard-sized tensor (the
    # shard's gradient, the reduce-scatter's result, lives from the backward's end to zero_grad and is
    # counted as the step makes it)
    held = state_factor if zero_axis is None else state_factor + 1
    resident = {"parameters": _per_rank_bytes(weights), "optimizer state": _per_rank_bytes(states, held),
                "gradient buckets": dict(live.kept)}
    by_rank = {r: sum(part.get(r, 0) for part in resident.values()) + live.peak.get(r, 0) for r in ranks}
    # the gradients in buckets are in "gradient buckets"; the rest appear during the step
    gradients = {r: max(n - live.kept.get(r, 0), 0) for r, n in _per_rank_bytes(grads).items()}
    parts = {**resident, "gradients": gradients,
             "activations": {r: max(live.peak.get(r, 0) - gradients.get(r, 0), 0) for r in ranks}}
    cost = Cost(prof.bytes_sent, prof.count, 0.0, max(by_rank.values()),
                {k: max(v.get(r, 0) for r in ranks) for k, v in parts.items()}, list(prof.events), tally, by_rank)
    cost.seconds = predict_cost(cost, ranks, device or calibration.device, calibration.host,
                                stages=stages).seconds
    return cost


OPTIMIZER = "(optimizer step)"


def _optimizer_update(tally: ComputeTally, states: List[Layout], state_factor: int) -> None:
    """The optimizer's update on each rank's pieces, memory-bound: per piece one kernel for the
    parameter and two per state tensor (its update, its use), reading the gradient, the parameter
    and the states and writing the parameter and the states."""
    kernels = 1 + 2 * state_factor
    for lay in states:
        for r, nbytes in _per_rank_bytes([lay]).items():
            work = tally.kernels[r][("memory", lay.dtype, "optimizer", OPTIMIZER)]
            for _ in range(kernels):
                work.add(0, nbytes * (3 + 2 * state_factor) // kernels)


def _experts(model: nn.Module, experts):
    return contextlib.nullcontext() if experts is None else expert_parallel_applied(model, *experts)


def _optimizer_reads(params: Dict[str, GlobalTensor], zero_axis) -> None:
    """What the optimizer's step sends: each gradient read in its parameter's layout (a partial one
    reduced), or with ZeRO boxed to the shard (the buckets reduce-scattered it there already) and the
    updated shard all-gathered, as ZeroOptimizer.step does."""
    with torch.no_grad():
        for p in params.values():
            raw = torch._C.TensorBase.grad.__get__(p)
            if raw is None:
                continue
            if zero_axis is None:
                p.grad                                          # noqa: B018 -- the read boxes it
            else:
                shard = shard_sbp(p, zero_axis)
                raw.to_global(sbp=shard)
                p.detach().to_global(sbp=shard).to_global(sbp=p.sbp)
