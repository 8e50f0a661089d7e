"""``gt.compile(fn)``: a callable that runs ``fn`` from its captured graph on the actor runtime.

One graph per argument meta (position, placement, sbp, shape, dtype, requires_grad of every
tensor; the value of every other argument), cached. For a new meta the first call runs ``fn``
eagerly (``warmup``: optimizers create their state, lazily built buffers appear), the next one
captures it (a dry run, see capture.py) and every call from then on runs the graph. The settings of
an elementwise optimizer over global parameters (its learning rate, betas, weight decay, ...) are read
by the graph at each run (nn/optim_pieces.py); a graph is captured again when another plain-number
setting of an optimizer it steps has changed.

Outputs come back as global tensors (detached: the backward belongs inside ``fn``); global
tensors that ``fn`` reaches and updates (parameters, gradients, optimizer state) are updated
in place, as the eager call would.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Callable, Optional, Union

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..boxing import Layout
from ..comm import get_world
from ..observe.context import run_labelled
from ..nn.fed_numbers import FedNumber
from ..nn.grad_buckets import GradBuckets
from ..ops import rng
from ..ops.schema.args import SCALARS
from ..tensor import GlobalTensor, rebind_piece
from .capture import capture
from .cuda_graphs import graph_backend
from .graph_views import PlanView, chrome_trace, dot
from .lower import lower
from .program import Program
from .optim import capturable_optimizers, hyper_parameters, live_keys
from .runtime import Runtime
from ..schedules import SCHEDULES
from .segments import plan_segments



def _meta(leaf):
    if isinstance(leaf, GlobalTensor):
        return (leaf._layout, leaf.requires_grad)
    if isinstance(leaf, torch.Tensor):
        return ("tensor", tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad)
    if type(leaf) in SCALARS:
        return (type(leaf), leaf)
    try:
        hash(leaf)
    except TypeError:
        raise TypeError(f"gt.compile: an argument of type {type(leaf).__name__} is neither a tensor nor a "
                        f"hashable value; a compiled function takes tensors and plain values") from None
    return (type(leaf), leaf)


def _fed_key(spec, leaves: list):
    """The key of a graph fed the float arguments (their values left out); None without any."""
    if not any(type(x) is float for x in leaves):
        return None
    return (spec, tuple((float, "fed") if type(x) is float else _meta(x) for x in leaves))


def _flatten(args: tuple, kwargs: dict):
    """The argument leaves and their structure (hashable: a graph's key); positional tensors and plain
    values without pytree."""
    if not kwargs and all(type(a) not in (list, tuple, dict, type(None)) for a in args):
        return list(args), len(args)
    leaves, spec = tree_flatten((args, kwargs))
    return leaves, repr(spec)       # a TreeSpec holds its dict keys in a list before torch 2.7: unhashable


def _micro_slice(t: torch.Tensor, m: int, j: int) -> torch.Tensor:
    """The ``j``-th of ``m`` equal parts of ``t`` along dim 0."""
    n = t.shape[0] // m
    return t.narrow(0, j * n, n)


def micro_batch(leaf, i: int, m: int, j: int):
    """Micro-batch ``j`` of ``m`` of a tensor argument: each rank's piece split along dim 0."""
    if not isinstance(leaf, torch.Tensor):
        return leaf
    if leaf.dim() == 0 or leaf.shape[0] % m:
        raise ValueError(f"gt.compile(micro_batches={m}): tensor argument {i} has shape {tuple(leaf.shape)}; "
                         f"its dim 0 must split into {m} equal micro-batches")
    if not isinstance(leaf, GlobalTensor):
        return _micro_slice(leaf.detach(), m, j).requires_grad_(leaf.requires_grad)
    layout = leaf._layout
    small = Layout((layout.shape[0] // m,) + tuple(layout.shape[1:]), layout.dtype, layout.placement, layout.nd_sbp)
    pieces = {}
    for r, piece in leaf._pieces.items():
        if piece.shape[0] % m or small.piece_shape(r) != (piece.shape[0] // m,) + tuple(piece.shape[1:]):
            raise ValueError(f"gt.compile(micro_batches={m}): tensor argument {i} ({layout.nd_sbp} of shape "
                             f"{layout.shape}) does not split into {m} micro-batches of equal pieces on rank {r}")
        pieces[r] = _micro_slice(piece.detach(), m, j)
    return GlobalTensor(small, pieces).requires_grad_(leaf.requires_grad)


class _Graph:
    """One captured meta: its program, runtime and the optimizers it steps."""

    def __init__(self, program: Program, runtime: Runtime, optimizers: list, consumed: int, out_spec,
                 live: frozenset = frozenset()):
        self.program, self.runtime, self.optimizers, self.out_spec = program, runtime, optimizers, out_spec
        self.live = live                     # settings its tasks read at each run (actor_rt/optim.py)
        self.numbers_fed = False             # its float arguments are fed at each call (nn/fed_numbers.py)
        self.hyper = hyper_parameters(optimizers, live)
        self.consumed = consumed
        self.slots: list = []              # the sink refs, by result slot
        self.outputs, self.rebinds, self.grad_rebinds = [], [], []

        def slot(ref):
            self.slots.append(ref)
            if ref[0] == "task":
                runtime.tasks[ref[1]].sinks.append((ref[2], len(self.slots) - 1))
            return len(self.slots) - 1
        for out, refs in program.outputs:
            self.outputs.append((out, {r: slot(ref) for r, ref in refs.items()}))
        self.rebinds = [(w, r, slot(ref)) for w, r, ref in program.rebinds]
        self.grad_rebinds = [(i, layout, {r: slot(ref) for r, ref in refs.items()})
                             for i, layout, refs in program.grad_rebinds]

    def value(self, row: list, feed: list, slot: int):
        ref = self.slots[slot]
        if ref[0] == "task":
            return row[slot]
        if ref[0] == "feed":
            return feed[self.runtime.feed_index[ref[1]]]
        return ref[1]


def _own(value):
    """A result of a graph run as the caller's own tensor (a copy of a captured segment's static output)."""
    return value.clone() if isinstance(value, torch.Tensor) else value


def _close_all(graphs: dict) -> None:
    """End the stream threads of every graph (the end-of-data message) when the function goes away."""
    for graph in graphs.values():
        graph.runtime.close()


class CompiledFunction:
    """What ``gt.compile`` returns: call it like ``fn``; ``pipeline`` runs many calls overlapped."""

    def __init__(self, fn: Callable, registers: Union[int, Callable] = 2, micro_batches: int = 1,
                 bucket_bytes: int = 25 * 2 ** 20, warmup: int = 1, timeline: bool = False,
                 measure_memory: bool = False, streams: Union[None, str, Callable] = None,
                 cuda_graphs: bool = False, schedule: str = "gpipe"):
        if not callable(fn):
            raise TypeError(f"gt.compile: expected a function or an nn.Module, got {type(fn).__name__}")
        if not isinstance(micro_batches, int) or isinstance(micro_batches, bool) or micro_batches < 1:
            raise ValueError(f"gt.compile(micro_batches=): expected a positive int, got {micro_batches!r}")
        if not callable(registers) and (not isinstance(registers, int) or isinstance(registers, bool)
                                        or registers < 1):
            raise ValueError(f"gt.compile(registers=): expected a register count >= 1, got {registers!r}")
        if not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"gt.compile(warmup=): expected a non-negative int, got {warmup!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"gt.compile(schedule=): expected one of {', '.join(map(repr, SCHEDULES))}, got {schedule!r}")
        if not isinstance(cuda_graphs, bool):
            raise TypeError(f"gt.compile(cuda_graphs=): expected True or False, got {cuda_graphs!r}")
        GradBuckets(bucket_bytes)           # validates
        if streams not in (None, "shared", "device", "rank") and not callable(streams):
            raise ValueError(f"gt.compile(streams=): expected None, 'shared', 'device', 'rank' or a function of a "
                             f"task, got {streams!r}")
        self.fn, self.registers, self.micro_batches = fn, registers, micro_batches
        self.bucket_bytes, self.warmup = bucket_bytes, warmup
        self.timeline, self.measure_memory, self.streams = timeline, measure_memory, streams
        self.cuda_graphs, self.schedule = cuda_graphs, schedule
        self._graphs: dict = {}
        self._unfed: set = set()            # keys of float arguments found read other than by a clipping
        self._warm: dict = {}
        self._last: Optional[_Graph] = None
        self.captures = 0
        weakref.finalize(self, _close_all, self._graphs)

    # -- calling --------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self._calls([(args, kwargs)])[0]

    def pipeline(self, calls: list) -> list:
        """Run one call per item of ``calls`` (a tuple of arguments, or one argument), iterations
        overlapping as far as the registers allow; the outputs in order."""
        items = [(c if isinstance(c, tuple) else (c,), {}) for c in calls]
        return self._calls(items)

    def _calls(self, items: list) -> list:
        results, batch, batch_key = [], [], None
        for args, kwargs in items:
            leaves, spec = _flatten(args, kwargs)
            key, fed = self._key(spec, leaves)
            graph = self._graphs.get(key)
            if graph is not None and hyper_parameters(graph.optimizers, graph.live) != graph.hyper:
                warnings.warn("gt.compile: an optimizer's hyper-parameters changed since the capture, and the graph "
                              "holds them; capturing again (an elementwise torch.optim optimizer's settings are read "
                              "at each run, except under cuda_graphs=True: there pass lr as a tensor)", stacklevel=3)
                self._graphs.pop(key).runtime.close()
                graph = None
            if graph is None:
                results += self._flush(batch, batch_key)
                batch = []
                if self._warm.get(key, 0) < self.warmup:
                    self._warm[key] = self._warm.get(key, 0) + 1
                    results.append(self.fn(*args, **kwargs))
                    continue
                graph = self._capture(args, kwargs, fed_numbers=fed)
                if fed and not graph.numbers_fed:
                    self._unfed.add(key)          # a float argument is read elsewhere: keyed by value
                    key = (spec, tuple(_meta(x) for x in leaves))
                self._graphs[key] = graph
            if batch and key != batch_key:
                results += self._flush(batch, batch_key)
                batch = []
            batch.append((args, kwargs, leaves))
            batch_key = key
        results += self._flush(batch, batch_key)
        return results

    def _key(self, spec, leaves: list) -> tuple:
        """A call's graph key, and whether it is one whose float arguments are fed: they enter by type
        where they may be fed (none found read but by a clipping), else by value."""
        fed = _fed_key(spec, leaves)
        if fed is not None and fed not in self._unfed:
            return fed, True
        return (spec, tuple(_meta(x) for x in leaves)), False

    def _flush(self, batch: list, key) -> list:
        if not batch:
            return []
        graph = self._graphs[key]
        self._last = graph
        feeds = [self._feed(graph, leaves) for _, _, leaves in batch]
        try:
            rows = run_labelled("gt.compile graph", graph.runtime.run, feeds, len(graph.slots), phase="compiled")
        except Exception:
            self._graphs.pop(key, None)
            raise
        return [self._finish(graph, row, feed, leaves) for row, feed, (_, _, leaves) in zip(rows, feeds, batch)]

    def _feed(self, graph: _Graph, leaves: list) -> list:
        m = self.micro_batches
        base = rng.next_offset(graph.consumed * m) if graph.consumed else 0
        feed = []
        for key in graph.program.feeds:
            spec = graph.program.feed_specs[key]
            if spec[0] == "arg":
                _, i, rank, mb = spec
                x = leaves[i]
                piece = x._pieces[rank] if rank is not None else x
                if m > 1:
                    piece = _micro_slice(piece, m, mb)
                feed.append(piece.detach() if piece.requires_grad else piece)
            elif spec[0] == "number":
                _, i, dtype, device = spec
                feed.append(torch.tensor(float(leaves[i]), dtype=dtype, device=device))
            else:
                _, offset, stream, device, mb = spec
                feed.append(torch.tensor(rng.key_values(base + mb * graph.consumed + offset, stream),
                                         dtype=torch.int64, device=device))
        return feed

    def _finish(self, graph: _Graph, row: list, feed: list, leaves: list):
        out_leaves = []
        own = graph.runtime.graphs.segments      # CUDA graphs: a result is a static buffer, written again later
        value = (lambda s: _own(graph.value(row, feed, s))) if own else (lambda s: graph.value(row, feed, s))
        for out, slots in graph.outputs:
            if out.kind == "global":
                out_leaves.append(GlobalTensor(out.layout, {r: value(s) for r, s in slots.items()}))
            elif out.kind == "plain":
                out_leaves.append(value(slots[None]))
            else:
                out_leaves.append(out.value)
        for wref, r, s in graph.rebinds:
            t = wref()
            if t is not None:
                rebind_piece(t, r, graph.value(row, feed, s))
        for i, layout, slots in graph.grad_rebinds:
            leaves[i].grad = GlobalTensor(layout, {r: graph.value(row, feed, s) for r, s in slots.items()})
        spec = graph.out_spec
        return out_leaves[0] if spec.is_leaf() else tree_unflatten(out_leaves, spec)

    # -- capturing ------------------------------------------------------------------------
    def _capture(self, args, kwargs, fed_numbers: bool = False) -> _Graph:
        """The graph of a call. With ``fed_numbers``, first with each float argument a FedNumber
        (nn/fed_numbers.py): kept where none was read but by a clipping, each then fed at every
        call (``numbers_fed``); else captured again with the numbers themselves."""
        if fed_numbers:
            flat, tree = tree_flatten((args, kwargs))
            numbers = [FedNumber(x, i) for i, x in enumerate(flat) if type(x) is float]
            by_index = {n.index: n for n in numbers}
            try:
                graph = self._capture_once(*tree_unflatten([by_index.get(i, x) for i, x in enumerate(flat)], tree))
            except Exception:        # noqa: BLE001 -- a number refused or read: captured with the numbers below
                graph = None
            if graph is not None and not any(n.used for n in numbers):
                graph.numbers_fed = True
                return graph
            if graph is not None:
                graph.runtime.close()
            return self._capture_once(args, kwargs, retry=True)
        return self._capture_once(args, kwargs)

    def _capture_once(self, args, kwargs, retry: bool = False) -> _Graph:
        m = self.micro_batches
        if m > 1:
            leaves, spec = tree_flatten((args, kwargs))
            args, kwargs = tree_unflatten([micro_batch(x, i, m, 0) for i, x in enumerate(leaves)], spec)
        stepped: list = []
        buckets = GradBuckets(self.bucket_bytes) if m == 1 and self.bucket_bytes else None
        try:
            with capturable_optimizers(stepped, on_pieces=not self.cuda_graphs):
                cap = capture(self.fn, args, kwargs, on_leaf=buckets.watch if buckets else None,
                              optimizer_tasks=not self.cuda_graphs)
        finally:
            if buckets is not None:
                buckets.close()
        world = get_world()
        program = lower(cap, micro_batches=m, registers=self.registers,
                        collective_rank=None if world.simulated else world.rank, streams=self.streams,
                        schedule=self.schedule, exchange=None if world.simulated else world.gather_objects)
        backend = None
        if self.cuda_graphs:
            backend = graph_backend()
            backend.check()
            if self.captures and not retry:
                warnings.warn("gt.compile(cuda_graphs=True): the arguments' shapes or layouts changed; capturing "
                              "the step and its CUDA graphs again", stacklevel=4)
        runtime = Runtime(program, timeline=self.timeline, measure_memory=self.measure_memory, graphs=backend)
        if backend is not None and not runtime.graphs.segments:
            runtime.close()
            reasons = sorted({s.reason.split(" (")[0] for s in plan_segments(program, backend.device_type)})
            raise RuntimeError(f"gt.compile(cuda_graphs=True): no compute task of this step can be captured into a "
                               f"CUDA graph ({'; '.join(reasons) or 'no compute tasks'}); compile without "
                               f"cuda_graphs, or place the step's tensors on a CUDA placement")
        graph = _Graph(program, runtime, stepped, cap.rng_consumed, cap.out_spec, live_keys(cap.settings))
        self.captures += 1
        return graph

    # -- inspection -----------------------------------------------------------------------
    def _graph(self) -> _Graph:
        if self._last is None:
            raise RuntimeError("gt.compile: nothing is captured yet; call the compiled function first")
        return self._last

    @property
    def plan(self) -> PlanView:
        """The task graph of the last graph run: tasks, streams, registers, the registers' memory bound."""
        graph = self._graph()
        backend = graph.runtime.graphs.backend
        return PlanView(graph.program, backend.device_type if backend is not None else "cuda")

    def to_dot(self) -> str:
        """Graphviz text of the task graph, one cluster per rank, coloured by stream."""
        return dot(self._graph().program)

    def trace_to(self, path: str) -> str:
        """Write the last run's actor firings, and the streams' waits for inputs and credits, as
        Chrome-trace JSON (Perfetto, chrome://tracing); the graph records them when compiled with
        ``timeline=True`` (two clock reads per task, off by default)."""
        graph = self._graph()
        if not graph.runtime.timeline_on:
            raise RuntimeError("g.trace_to: this graph records no timeline; compile with "
                               "gt.compile(fn, timeline=True) to draw its actor firings")
        return chrome_trace(graph.runtime.timeline, path, {t.name: t.rank for t in graph.program.tasks},
                            graph.runtime.waits)

    @property
    def peak_register_bytes(self) -> int:
        """The most bytes the registers held at once (measured with ``measure_memory=True``)."""
        return self._graph().runtime.peak_bytes

    @property
    def peak_register_bytes_by_rank(self) -> dict:
        """Per rank, the most bytes its tasks' registers held at once (``measure_memory=True``): a
        pipeline stage's activations in flight."""
        return dict(self._graph().runtime.peak_bytes_by_rank)

    @property
    def peak_activation_bytes_by_rank(self) -> dict:
        """Per rank, the most bytes the registers of its micro-batches' forward tasks held at once, the
        arguments aside (``measure_memory=True``): a pipeline stage's activations in flight."""
        return dict(self._graph().runtime.peak_activation_bytes_by_rank)


def compile(fn: Callable, registers: Union[int, Callable] = 2, micro_batches: int = 1, *,
            bucket_bytes: int = 25 * 2 ** 20, warmup: int = 1, timeline: bool = False,
            measure_memory: bool = False, streams: Union[None, str, Callable] = None,
            cuda_graphs: bool = False, schedule: str = "gpipe") -> CompiledFunction:
    """Capture ``fn`` (a function or an ``nn.Module``) into a static graph run by the actor runtime.

    ``registers``: output slots per task (an int, or a function of a task giving its count): how
    many iterations a producer may run ahead of its slowest consumer. ``micro_batches=m`` splits
    every tensor argument along dim 0 into m micro-batches that flow through the graph; their
    gradients are averaged and the optimizer runs once. ``bucket_bytes``: data-parallel
    gradients are all-reduced in buckets of about this size while the backward runs (0: one by
    one when read). ``warmup``: eager calls before the capture, per argument meta. ``timeline``:
    record each task's firing for ``trace_to`` (two clock reads per task). ``streams``: which
    tasks share a stream (lower.py; by default each rank's own in a process world, each device's in
    a simulated one -- one stream on the CPU, run on the caller's thread). ``cuda_graphs``: replay
    each capturable run of a CUDA stream's tasks from a CUDA graph, captured per register slot
    (cuda_graphs.py; ``g.plan.segments`` says which runs, and why not the others); a GPU only.
    ``schedule``: with micro-batches over pipeline stages, the order of their forwards and backwards
    -- ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"zero_bubble"`` or ``"zbv"`` (globaltensor/schedules.py): each stage
    holds at most the micro-batches its schedule allows, enforced by the runtime's dependencies.
    """
    return CompiledFunction(fn, registers, micro_batches, bucket_bytes, warmup, timeline, measure_memory, streams,
                            cuda_graphs, schedule)
