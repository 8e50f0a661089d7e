"""The actor runtime: one OS thread per stream, tasks as actors with credits.

Each task is an actor with ``registers`` output slots; iteration ``it`` writes slot
``it % registers``. A task acts on iteration ``it`` when every input is ready -- its producer has
done ``it`` ("ready") -- and a register is free -- every consumer has done ``it - registers``
("ack": the consumer is through with the slot, so it may be written again). The counters are
each task's ``done`` (iterations finished), read by consumers for readiness and by producers for
credit; a thread that must wait sleeps on its stream's condition, which the other side notifies.

A stream's thread runs its tasks in their static order, iteration after iteration, with no queue
between them: a task's inputs from the same stream are ready by that order, and its credit from
same-stream consumers always holds (they finished the previous iteration). Threads meet only at
cross-stream edges. Several iterations are in flight at once, as far as the credits allow:
memory is bounded by the registers, and pipelining comes from the credits.

On CUDA each stream thread owns a ``torch.cuda.Stream``; a cross-stream input waits on the CUDA
event its producer recorded, and the tensor is marked as used by the consumer's stream.

An exception in any task stops the graph: every thread leaves its loop, and the caller gets an
error naming the task (op and rank). The graph is broken after that (``CompiledFunction``
captures again on the next call).
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Dict, List

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..comm import get_world
from .capture import storage_key
from .graph import Ref
from .lower import Program, TaskSpec


class GraphError(RuntimeError):
    """An op raised inside a compiled graph."""


class _Stop(Exception):
    """The graph failed elsewhere: leave the loop."""


class Task:
    __slots__ = ("spec", "name", "k", "regs", "done", "run", "waits_in", "waits_credit", "notify", "sinks",
                 "cuda_waits", "events", "record_streams", "stream")

    def __init__(self, spec: TaskSpec):
        self.spec, self.name, self.k = spec, spec.name, spec.registers
        self.regs: list = [None] * spec.registers
        self.done = 0
        self.waits_in: list = []       # (producer, delay) on other streams
        self.waits_credit: list = []   # consumers on other streams
        self.notify: list = []         # streams to wake when this task finishes an iteration
        self.sinks: list = []          # (output position, result slot)
        self.cuda_waits: list = []     # producers on other CUDA streams
        self.events = None
        self.record_streams: list = []


class Stream:
    def __init__(self, name: str, tasks: List[Task], device):
        self.name, self.tasks, self.device = name, tasks, device
        self.cond = threading.Condition()
        self.jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self.finished = 0
        self.cuda_stream = None
        self.thread = None


class Feed:
    """The caller's side: it fills a register with each iteration's arguments and random keys."""

    def __init__(self, registers: int):
        self.name, self.k = "feed", registers
        self.regs: list = [None] * registers
        self.done = 0
        self.cond = threading.Condition()
        self.consumers: list = []


def _mean(*xs):
    if not (xs[0].is_floating_point() or xs[0].is_complex()):
        return xs[-1]
    out = xs[0] + xs[1]
    for x in xs[2:]:
        out.add_(x)
    return out.div_(len(xs))


def _expression(src, names: dict, namespace: dict) -> str:
    kind = src[0]
    if kind == "const":
        name = f"C{len(namespace)}"
        namespace[name] = src[1]
        return name
    if kind == "feed":
        return f"F.regs[it % {names['feed_k']}][{names['feed'][src[1]]}]"
    tid, out = src[1], src[2]
    k = names["k"][tid]
    return f"T{tid}.regs[{'0' if k == 1 else f'it % {k}'}][{out}]"


def _constant(v, namespace: dict) -> str:
    if v is None or type(v) in (bool, int):
        return repr(v)
    name = f"K{len(namespace)}"
    namespace[name] = v
    return name


def _compile_task(spec: TaskSpec, names: dict, namespace: dict, world) -> str:
    """Python source of ``run(it)`` for one task: its op on its inputs' registers, outputs as a tuple."""
    if spec.node is None:
        ins = ", ".join(_expression(s, names, namespace) for s in spec.inputs)
        return f"def run(it):\n    return (_mean({ins}),)\n"
    n = spec.node
    by_vid = {vid: _expression(src, names, namespace) for vid, src in zip(n.inputs, spec.inputs)}

    def one(v):
        if isinstance(v, Ref):
            return by_vid[v.vid]
        if isinstance(v, (list, tuple)) and any(isinstance(x, Ref) for x in v):
            inner = ", ".join(one(x) for x in v)
            return f"[{inner}]" if isinstance(v, list) else f"({inner},)"
        return _constant(v, namespace)
    if n.kind == "collective":
        leaves, spec_tree = n.args
        namespace["SPEC"] = spec_tree
        namespace["COLL"] = getattr(world, n.target)
        body = ", ".join(one(x) for x in leaves)
        return (f"def run(it):\n    return tuple(_flat(COLL(*_unflat([{body}], SPEC)))[0])\n")
    args, kwargs = n.args
    namespace["OP"] = n.target._op
    call = ", ".join([one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()])
    if n.out_slots is None:
        return f"def run(it):\n    return (OP({call}),)\n"
    picks = "".join(f"o[{j}], " for j in n.out_slots)
    return f"def run(it):\n    o = OP({call})\n    return ({picks})\n"


class Runtime:
    def __init__(self, program: Program, timeline: bool = True, measure_memory: bool = False):
        self.program = program
        self.world = get_world()
        self.timeline_on, self.measure = timeline, measure_memory
        self.timeline: list = []
        self.peak_bytes = 0
        self.failed = None
        self.broken = False
        self.lock = threading.Lock()
        self.done_cond = threading.Condition()
        specs = program.tasks
        self.tasks = [Task(s) for s in specs]
        self.feed = Feed(max([s.registers for s in specs], default=2))
        self.feed_index = {key: i for i, key in enumerate(program.feeds)}
        self.external = set()
        for s in specs:
            for src in s.inputs:
                if src[0] == "const":
                    self.external.add(storage_key(src[1]))
        names = {"k": {s.id: s.registers for s in specs}, "feed": self.feed_index, "feed_k": self.feed.k}
        for t in self.tasks:
            namespace = {"_mean": _mean, "_flat": tree_flatten, "_unflat": tree_unflatten, "F": self.feed}
            namespace.update({f"T{s[1]}": self.tasks[s[1]] for s in t.spec.inputs if s[0] == "task"})
            source = _compile_task(t.spec, names, namespace, self.world)
            exec(compile(source, f"<task {t.name}>", "exec"), namespace)
            t.run = namespace["run"]
        self.streams: Dict[str, Stream] = {}
        for name, ids in program.order.items():
            tasks = [self.tasks[i] for i in ids]
            device = next((s.spec.device for s in tasks if s.spec.device is not None and
                           s.spec.device.type == "cuda"), None)
            self.streams[name] = Stream(name, tasks, device)
            for t in tasks:
                t.stream = self.streams[name]
        self._wire()
        self.results: dict = {}

    def _wire(self) -> None:
        tasks = self.tasks
        for t in tasks:
            for src in t.spec.inputs:
                if src[0] == "feed":
                    if t not in self.feed.consumers:
                        self.feed.consumers.append(t)
                    t.waits_in.append((self.feed, 0))
                elif src[0] == "task":
                    p = tasks[src[1]]
                    if p.stream is not t.stream:
                        t.waits_in.append((p, 0))
                        p.waits_credit.append(t)
                        if t.stream.device is not None and p.stream.device is not None:
                            t.cuda_waits.append(p)
                            p.record_streams.append(t.stream)
            for pid, delay in t.spec.deps:
                p = tasks[pid]
                if p.stream is not t.stream:
                    t.waits_in.append((p, delay))
                    if t.stream.device is not None and p.stream.device is not None:
                        t.cuda_waits.append(p)
        for t in tasks:
            t.waits_in = list(dict.fromkeys(t.waits_in))
            t.waits_credit = list(dict.fromkeys(t.waits_credit))
            t.cuda_waits = list(dict.fromkeys(t.cuda_waits))
            for p, _ in t.waits_in:
                if isinstance(p, Task):
                    p.notify.append(t.stream)
            for c in t.waits_credit:
                c.notify.append(t.stream)
            if any(p is self.feed for p, _ in t.waits_in):
                t.notify.append(self.feed)
            if t.record_streams:
                t.events = [None] * t.k
        for t in tasks:
            t.notify = list({id(s): s for s in t.notify if s is not t.stream}.values())

    # -- threads --------------------------------------------------------------------------
    def _start(self) -> None:
        for s in self.streams.values():
            if s.thread is None:
                s.thread = threading.Thread(target=self._loop, args=(s,), name=f"gt-actor-{s.name}", daemon=True)
                s.thread.start()

    def close(self) -> None:
        for s in self.streams.values():
            if s.thread is not None:
                s.jobs.put(None)
                s.thread = None

    def _loop(self, stream: Stream) -> None:
        if stream.device is not None:
            torch.cuda.set_device(stream.device)
            stream.cuda_stream = torch.cuda.Stream(stream.device)
            with torch.cuda.stream(stream.cuda_stream):
                self._serve(stream)
        else:
            self._serve(stream)

    def _serve(self, stream: Stream) -> None:
        tasks, timeline = stream.tasks, self.timeline
        while True:
            job = stream.jobs.get()
            if job is None:
                return
            start, stop = job
            t = None
            try:
                with torch.no_grad():
                    for it in range(start, stop):
                        for t in tasks:
                            if t.waits_in or t.waits_credit:
                                self._wait(stream, t, it)
                            if t.cuda_waits:
                                self._cuda_wait(t, it)
                            t0 = time.perf_counter() if self.timeline_on else 0.0
                            outs = t.run(it)
                            t.regs[it % t.k] = outs
                            if t.sinks:
                                row = self.results[it]
                                for j, slot in t.sinks:
                                    row[slot] = outs[j]
                            if t.events is not None:
                                self._cuda_publish(t, it, outs)
                            if self.timeline_on:
                                timeline.append((stream.name, t.name, it, t0, time.perf_counter()))
                            t.done = it + 1
                            for s in t.notify:
                                with s.cond:
                                    s.cond.notify_all()
                            if self.measure:
                                self._sample_memory()
                        stream.finished = it + 1
            except _Stop:
                pass
            except BaseException as e:  # noqa: BLE001 -- every failure must reach the caller
                self._fail(e, t)
            with self.done_cond:
                stream.finished = max(stream.finished, stop) if self.failed is None else stream.finished
                self.done_cond.notify_all()

    def _wait(self, stream: Stream, t: Task, it: int) -> None:
        cond = stream.cond
        for p, delay in t.waits_in:
            need = it + 1 - delay
            if p.done < need:
                with cond:
                    while p.done < need:
                        if self.failed is not None:
                            raise _Stop
                        cond.wait()
        need = it + 1 - t.k
        for c in t.waits_credit:
            if c.done < need:
                with cond:
                    while c.done < need:
                        if self.failed is not None:
                            raise _Stop
                        cond.wait()

    def _cuda_wait(self, t: Task, it: int) -> None:
        current = torch.cuda.current_stream()
        for p in t.cuda_waits:
            ev = p.events[(it % p.k)] if p.events is not None else None
            if ev is not None:
                current.wait_event(ev)

    def _cuda_publish(self, t: Task, it: int, outs) -> None:
        ev = torch.cuda.Event()
        ev.record()
        t.events[it % t.k] = ev
        for o in outs:
            if isinstance(o, torch.Tensor) and o.is_cuda:
                for s in t.record_streams:
                    if s.cuda_stream is not None:
                        o.record_stream(s.cuda_stream)

    def _fail(self, e: BaseException, t) -> None:
        with self.lock:
            if self.failed is None:
                self.failed = (e, t)
        self.broken = True
        for s in self.streams.values():
            with s.cond:
                s.cond.notify_all()
        with self.feed.cond:
            self.feed.cond.notify_all()
        with self.done_cond:
            self.done_cond.notify_all()

    def _sample_memory(self) -> None:
        seen, total = set(), 0
        for t in self.tasks:
            for slot in t.regs:
                for o in slot or ():
                    if isinstance(o, torch.Tensor):
                        key = storage_key(o)
                        if key is not None and key not in seen and key not in self.external:
                            seen.add(key)
                            total += o.untyped_storage().nbytes()
        self.peak_bytes = max(self.peak_bytes, total)

    # -- a run ----------------------------------------------------------------------------
    def run(self, feeds: List[list], sink_count: int) -> List[list]:
        """Run ``len(feeds)`` iterations, overlapping as the credits allow; each iteration's sink values."""
        if self.broken:
            raise GraphError("globaltensor: this compiled graph failed before and cannot run again")
        self._start()
        base = self.feed.done
        n = len(feeds)
        self.timeline.clear()
        self.results = {base + i: [None] * sink_count for i in range(n)}
        for s in self.streams.values():
            s.jobs.put((base, base + n))
        feed = self.feed
        for i, values in enumerate(feeds):
            it = base + i
            need = it + 1 - feed.k
            for c in feed.consumers:
                if c.done < need:
                    with feed.cond:
                        while c.done < need and self.failed is None:
                            feed.cond.wait()
            if self.failed is not None:
                break
            feed.regs[it % feed.k] = values
            feed.done = it + 1
            for s in {id(c.stream): c.stream for c in feed.consumers}.values():
                with s.cond:
                    s.cond.notify_all()
        end = base + n
        with self.done_cond:
            while self.failed is None and any(s.finished < end for s in self.streams.values()):
                self.done_cond.wait()
        if self.failed is not None:
            self._raise()
        results = [self.results[base + i] for i in range(n)]
        self.results = {}
        for t in self.tasks:
            t.regs = [None] * t.k
        feed.regs = [None] * feed.k
        return results

    def _raise(self):
        e, t = self.failed
        self.close()
        where = f"task {t.name} (op {t.spec.node.label if t.spec.node is not None else 'mean'}, rank {t.spec.rank})" \
            if t is not None else "a task"
        raise GraphError(f"globaltensor: {where} raised in the compiled graph: {type(e).__name__}: {e}") from e
