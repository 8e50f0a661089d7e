"""The actor runtime: one OS thread per stream, tasks as actors with credits.

Each task is an actor with ``registers`` output slots; iteration ``it`` writes slot
``it % registers``. A task acts on iteration ``it`` when every input is ready -- its producer has
done ``it`` ("ready") -- and a register is free -- every consumer has done ``it - registers``
("ack": the consumer is through with the slot, so it may be written again). The counters are
each task's ``done`` (iterations finished), read by consumers for readiness and by producers for
credit; a thread that must wait sleeps on its stream's condition, which the other side notifies
(with the timeline on, each sleep is recorded in ``waits``: ``g.trace_to`` draws it).

A stream's thread runs its tasks in their static order, iteration after iteration, with no queue
between them: a task's inputs from the same stream are ready by that order, and its credit from
same-stream consumers always holds (they finished the previous iteration). Threads meet only at
cross-stream edges. Several iterations are in flight at once, as far as the credits allow:
memory is bounded by the registers, and pipelining comes from the credits.

On CUDA each stream thread owns a ``torch.cuda.Stream``; a cross-stream input waits on the CUDA
event its producer recorded, and a producer refilling a register slot waits on its consumers'
events of the slot's last use (cuda_handover.py: one event per task and slot, no ``record_stream``).

An exception in any task stops the graph: every thread leaves its loop, and the caller gets an
error naming the task (op and rank). In a process world the failure is also published for the
other ranks (``World.report_failure``): their graphs stop when their next collective with this
rank fails, and that error names this rank's task and op. The graph is broken after that
(``CompiledFunction`` captures again on the next call).
"""
from __future__ import annotations

import gc
import queue
import threading
import time
from typing import Dict, List

import torch

from ..comm import get_world
from . import cuda_handover
from .capture import storage_key
from .program import Program, TaskSpec
from .shutdown import stop_at_exit
from .cuda_graphs import GraphPlan
from .stream_code import PART, StreamCode


# how long a failed graph waits for its stream threads to leave the op or collective they are in
STOP_WAIT_S = 5.0


class GraphError(RuntimeError):
    """An op raised inside a compiled graph."""


class _Stop(Exception):
    """The graph failed elsewhere: leave the loop."""


class Countdown:
    """The readers of a register read across streams still to read each slot; the last one to read it
    empties it, as a stream empties a register only its own tasks read once the last has run. Held
    until the next iteration overwrites it instead, the per-micro-batch activations a pipeline stage
    receives would all stay until the next call, whatever its schedule."""

    __slots__ = ("task", "readers", "left", "lock")

    def __init__(self, task: "Task", readers: int):
        self.task, self.readers = task, readers
        self.left = [0] * task.k
        self.lock = threading.Lock()

    def arm(self, slot: int) -> None:
        self.left[slot] = self.readers

    def read(self, slot: int) -> None:
        with self.lock:
            self.left[slot] -= 1
            if not self.left[slot]:
                self.task.regs[slot] = None


class Task:
    __slots__ = ("spec", "name", "k", "regs", "done", "waits_in", "waits_credit", "notify", "sinks",
                 "cuda_waits", "events", "cuda_consumers", "stream", "consumers", "countdown")

    def __init__(self, spec: TaskSpec):
        self.spec, self.name, self.k = spec, spec.name, spec.registers
        self.regs: list = [None] * spec.registers
        self.done = 0
        self.waits_in: list = []       # (producer, delay) on other streams
        self.waits_credit: list = []   # consumers on other streams
        self.notify: list = []         # streams to wake when this task finishes an iteration
        self.sinks: list = []          # (output position, result slot)
        self.cuda_waits: list = []     # producers on other CUDA streams
        self.events = None             # CUDA: one event per register slot (cuda_handover.py)
        self.cuda_consumers: list = []  # the tasks of other CUDA streams reading its register
        self.consumers: list = []      # the tasks reading its register
        self.countdown = None          # read across streams (not CUDA ones): its readers' Countdown


class Stream:
    def __init__(self, name: str, tasks: List[Task], device):
        self.name, self.tasks, self.device = name, tasks, device
        self.cond = threading.Condition()
        self.jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self.finished = 0
        self.cuda_stream = None
        self.thread = None
        self.end_event = None          # CUDA: recorded when a job's last iteration is queued
        self.code = None               # its iteration, generated at the first run
        self.line_task: dict = {}


class Feed:
    """The caller's side: it fills a register with each iteration's arguments and random keys."""

    def __init__(self, registers: int):
        self.k = registers
        self.regs: list = [None] * registers
        self.done = 0
        self.cond = threading.Condition()
        self.consumers: list = []      # the tasks reading it
        self.notify: list = []         # their streams, but the caller's own


class Runtime:
    """One compiled graph's actors, streams and threads; ``run`` feeds it iterations."""

    def __init__(self, program: Program, timeline: bool = True, measure_memory: bool = False, graphs=None):
        self.program = program
        self.graphs = GraphPlan(program, graphs, PART)     # CUDA graphs of the capturable segments
        self.world = get_world()
        self.timeline_on, self.measure = timeline, measure_memory
        self.timeline: list = []
        self.waits: list = []          # (stream, task, iteration, start, end, "input" | "credit", on what)
        self.peak_bytes = 0
        self.peak_bytes_by_rank: dict = {}      # rank -> the most bytes its tasks' registers held at once
        self.peak_activation_bytes_by_rank: dict = {}   # the same, of its micro-batches' forward tasks
        self.failed = None             # (exception, task) once a task raised: the graph is broken
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
        self.stored: list = []          # the tasks whose outputs sit in their registers (stream_code.py)
        # the caller's thread is the thread of the busiest CPU stream while a run lasts: a graph on
        # one stream then runs with no hand-off between threads at all
        cpu = [s for s in self.streams.values() if s.device is None]
        self.inline = max(cpu, key=lambda s: len(s.tasks)) if cpu else None
        self.feed.notify = list({id(c.stream): c.stream for c in self.feed.consumers
                                 if c.stream is not self.inline}.values())
        for t in self.inline.tasks if self.inline is not None else ():   # the feed is filled on this thread
            t.waits_in = [(p, d) for p, d in t.waits_in if p is not self.feed]
            t.notify = [s for s in t.notify if s is not self.feed]

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
                    if t not in p.consumers:
                        p.consumers.append(t)
                    if p.stream is not t.stream:
                        t.waits_in.append((p, 0))
                        p.waits_credit.append(t)
                        if t.stream.device is not None and p.stream.device is not None:
                            t.cuda_waits.append(p)
                            p.cuda_consumers.append(t)
            for pid, delay in t.spec.deps:
                p = tasks[pid]
                if p.stream is not t.stream:
                    t.waits_in.append((p, delay))
                    if t.stream.device is not None and p.stream.device is not None:
                        t.cuda_waits.append(p)
                        p.events = p.events or [None] * p.k
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
            t.cuda_consumers = list(dict.fromkeys(t.cuda_consumers))
            if t.waits_credit and not t.cuda_consumers:
                t.countdown = Countdown(t, len(t.consumers))
            if t.cuda_consumers or t.cuda_waits:
                t.events = t.events or [None] * t.k
        for t in tasks:
            t.notify = list({id(s): s for s in t.notify if s is not t.stream}.values())
        # the tasks whose ``done`` another stream, a credit or the feed reads; others need not count
        self.done_read = ({p for t in tasks for p, _ in t.waits_in if isinstance(p, Task)}
                          | {c for t in tasks for c in t.waits_credit} | set(self.feed.consumers))

    # -- threads --------------------------------------------------------------------------
    def _start(self) -> None:
        for s in self.streams.values():
            if s.code is None:
                code = StreamCode(self, s)
                s.code, s.line_task = code.build(), code.line_task
                self.stored.extend(code.stored)
            if s.thread is None and s is not self.inline:
                s.thread = threading.Thread(target=self._loop, args=(s,), name=f"gt-actor-{s.name}", daemon=True)
                s.thread.start()
                stop_at_exit(self)

    def close(self) -> None:
        for s in self.streams.values():
            if s.thread is not None:
                s.jobs.put(None)
                s.thread = None

    def stop(self) -> None:
        """Close the stream threads and wait for them (a bounded time): after this no thread of the
        runtime is inside an op, a collective or a CUDA call."""
        threads = [s.thread for s in self.streams.values() if s.thread is not None]
        self.close()
        deadline = time.monotonic() + STOP_WAIT_S
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _loop(self, stream: Stream) -> None:
        if stream.device is not None:
            torch.cuda.set_device(stream.device)
            stream.cuda_stream = torch.cuda.Stream(stream.device)
            with torch.cuda.stream(stream.cuda_stream):
                self._serve(stream)
        else:
            self._serve(stream)

    def _serve(self, stream: Stream) -> None:
        iteration = stream.code
        while True:
            job = stream.jobs.get()
            if job is None:
                return
            start, stop, ready = job
            try:
                if ready is not None:                  # the caller's stream made the arguments
                    torch.cuda.current_stream().wait_event(ready)
                with torch.no_grad():
                    for it in range(start, stop):
                        iteration(it, self.results)
                        stream.finished = it + 1
                if stream.cuda_stream is not None:     # the caller waits on this before using results
                    stream.end_event = torch.cuda.Event()
                    stream.end_event.record()
            except _Stop:
                pass
            except BaseException as e:  # noqa: BLE001 -- every failure must reach the caller
                self._fail(e, self._task_at(stream, e))
            with self.done_cond:
                self.done_cond.notify_all()

    def _task_at(self, stream: Stream, e: BaseException):
        """The task whose line of the stream's code raised."""
        tb, task = e.__traceback__, None
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == f"<stream {stream.name}>":
                task = stream.line_task.get(tb.tb_lineno, task)
            tb = tb.tb_next
        return task

    def _waiter(self, stream: Stream, t: Task):
        return lambda it: self._wait(stream, t, it)

    def _cuda_waiter(self, t: Task):
        return lambda it: cuda_handover.wait(t, it)

    def _cuda_publisher(self, t: Task):
        return lambda it: cuda_handover.publish(t, it)

    def _wait(self, stream: Stream, t: Task, it: int) -> None:
        """Until every input of iteration ``it`` is ready and a register is free (ready, then ack)."""
        for p, delay in t.waits_in:
            self._await(stream, t, it, p, it + 1 - delay, "input")
        for c in t.waits_credit:
            self._await(stream, t, it, c, it + 1 - t.k, "credit")

    def _await(self, stream: Stream, t: Task, it: int, other, done: int, why: str) -> None:
        """Sleep on the stream's condition until ``other`` has finished ``done`` iterations (or the
        graph failed). A sleep is recorded in ``waits`` when the timeline is on: the trace then
        tells a stream waiting for an input or a credit from one stalled while it could run."""
        if other.done >= done:
            return
        start = time.perf_counter()
        with stream.cond:
            while other.done < done:
                if self.failed is not None:
                    raise _Stop
                stream.cond.wait()
        if self.timeline_on:
            self.waits.append((stream.name, t.name, it, start, time.perf_counter(), why,
                               other.name if isinstance(other, Task) else "the call's arguments"))

    def _fail(self, e: BaseException, t) -> None:
        with self.lock:
            first = self.failed is None
            if first:
                self.failed = (e, t)
        if first:
            self.world.report_failure(f"GraphError: {_failure_text(e, t)}")
        for s in self.streams.values():
            with s.cond:
                s.cond.notify_all()
        with self.feed.cond:
            self.feed.cond.notify_all()
        with self.done_cond:
            self.done_cond.notify_all()

    def _sample_memory(self) -> None:
        """The bytes of the storages the registers hold now, other than state (a view of a parameter
        costs the registers nothing; a view of an argument keeps the argument alive, and counts)."""
        seen, total, by_rank, micro = set(self.external), 0, {}, {}
        arguments = {storage_key(o) for slot in self.feed.regs for o in slot or () if isinstance(o, torch.Tensor)}
        for t in self.tasks:
            for slot in t.regs:
                for o in slot or ():
                    if isinstance(o, torch.Tensor):
                        key = storage_key(o)
                        if key is not None and key not in seen:
                            seen.add(key)
                            size = o.untyped_storage().nbytes()
                            total += size
                            by_rank[t.spec.rank] = by_rank.get(t.spec.rank, 0) + size
                            if t.spec.mb is not None and t.spec.node is not None and not t.spec.node.backward \
                                    and key not in arguments:
                                micro[t.spec.rank] = micro.get(t.spec.rank, 0) + size
        self.peak_bytes = max(self.peak_bytes, total)
        for peaks, now in ((self.peak_bytes_by_rank, by_rank), (self.peak_activation_bytes_by_rank, micro)):
            for rank, size in now.items():
                peaks[rank] = max(peaks.get(rank, 0), size)

    # -- a run ----------------------------------------------------------------------------
    def run(self, feeds: List[list], sink_count: int) -> List[list]:
        """Run ``len(feeds)`` iterations, overlapping as the credits allow; each iteration's sink values.

        Python's cyclic garbage collector is paused meanwhile: the graph's ops make tensors by the
        ten thousand and no reference cycle, and each collection would walk the graph's own objects
        (tens of thousands of tasks on a simulated mesh of 64 ranks); it runs again after."""
        if self.failed is not None:
            raise GraphError("globaltensor: this compiled graph failed before and cannot run again")
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._run(feeds, sink_count)
        finally:
            if collecting:
                gc.enable()

    def _run(self, feeds: List[list], sink_count: int) -> List[list]:
        self._start()
        base = self.feed.done
        n = len(feeds)
        self.timeline.clear()
        self.waits.clear()
        self.results = {base + i: [None] * sink_count for i in range(n)}
        inline = self.inline
        ready = None
        if any(s.device is not None for s in self.streams.values()):
            ready = torch.cuda.Event()
            ready.record()
        for s in self.streams.values():
            if s is not inline:
                s.jobs.put((base, base + n, ready))
        with torch.no_grad():
            filled = 0
            for i in range(n):
                it = base + i
                while filled <= i or (filled < n and self._feed_free(base + filled)):
                    if not self._fill(base + filled, feeds[filled]):
                        break
                    filled += 1
                if self.failed is not None:
                    break
                if inline is not None:
                    try:
                        inline.code(it, self.results)
                    except _Stop:
                        break
                    except BaseException as e:  # noqa: BLE001 -- it is re-raised below, with its task
                        self._fail(e, self._task_at(inline, e))
                        break
                    inline.finished = it + 1
        end = base + n
        with self.done_cond:
            while self.failed is None and any(s.finished < end for s in self.streams.values()):
                self.done_cond.wait()
        if self.failed is not None:
            self._raise()
        for s in self.streams.values():
            if s.end_event is not None:
                torch.cuda.current_stream().wait_event(s.end_event)
                s.end_event = None
        results = [self.results[base + i] for i in range(n)]
        self.results = {}
        for t in self.stored:
            t.regs = [None] * t.k
        self.feed.regs = [None] * self.feed.k
        return results

    def _feed_free(self, it: int) -> bool:
        need = it + 1 - self.feed.k
        return all(c.done >= need for c in self.feed.consumers)

    def _fill(self, it: int, values: list) -> bool:
        """Put iteration ``it``'s arguments into the feed once its register is free (False: failed).
        The feed runs ahead of the caller's own stream as far as its registers allow, so other
        streams are not held back while the caller's stream waits within an iteration."""
        feed = self.feed
        if not self._feed_free(it):
            with feed.cond:
                while not self._feed_free(it) and self.failed is None:
                    feed.cond.wait()
        if self.failed is not None:
            return False
        feed.regs[it % feed.k] = values
        feed.done = it + 1
        for s in feed.notify:
            with s.cond:
                s.cond.notify_all()
        return True

    def _raise(self):
        """Stop the stream threads and re-raise the failure. The threads are waited for (a bounded
        time) so that none is still inside an op or a collective -- C++ frames -- if the error ends
        the program: a daemon thread returning from one while the interpreter finalizes aborts the
        process ("terminate called without an active exception"). A thread left waiting on its
        condition or its queue is only Python and may stay."""
        e, t = self.failed
        self.stop()
        raise GraphError(_failure_text(e, t)) from e


def _failure_text(e: BaseException, t) -> str:
    where = "a task"
    if t is not None:
        node = t.spec.node
        op = "mean over micro-batches" if node is None else " ".join(filter(None, (node.label, node.signature)))
        where = f"task {t.name} (op {op}, rank {t.spec.rank})"
    return f"globaltensor: {where} raised in the compiled graph: {type(e).__name__}: {e}"
