"""The Python source of one stream's iteration, generated once per compiled graph: its tasks' ops in
static order, straight-line (runtime.py runs it on the stream's thread).

A task's inputs are read from the producer's register (``T7.regs[it % 2][0]``), or from a local
when the producer ran earlier in the same generated function of this stream; its outputs go to its
own register only where something else reads it (another stream or function, the memory sampler),
and its ``done`` counter is kept only where another stream or the caller waits on it. Waits, events,
timeline entries and notifications appear only where a task has them, so the common task costs
its op call and a local store.

With CUDA graphs (cuda_graphs.py) a captured segment's tasks are one call instead: every wait of
its tasks first, then the segment's graph (``G7(it, [inputs])``, its body a function generated here
from the same op calls), then each task's bookkeeping on the graph's outputs.
"""
from __future__ import annotations

import time

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .bindings import fast_call
from .cuda_graphs import SegmentGraph
from .graph import Ref, StorageRef
from .recycle import recycled


PART = 256      # tasks per generated function


def _fold(acc, x, j: int, m: int):
    """Step ``j`` of the mean over ``m`` micro-batches: ``acc`` holds the sum of the ones before."""
    if not (x.is_floating_point() or x.is_complex()):
        return x                                 # counts and indices: the last micro-batch's
    out = acc + x if j == 1 else acc.add_(x)
    return out.div_(m) if j == m - 1 else out


def _constant(v, namespace: dict) -> str:
    if v is None or type(v) in (bool, int):
        return repr(v)
    name = f"K{len(namespace)}"
    namespace[name] = v
    return name


class StreamCode:
    """Builds one stream's ``iteration(it, RESULTS)`` function (see the module's docstring)."""

    def __init__(self, runtime, stream):
        self.rt, self.stream = runtime, stream
        self.ns = {"_fold": _fold, "_flat": tree_flatten, "_unflat": tree_unflatten, "F": runtime.feed,
                   "CLOCK": time.perf_counter, "TL": runtime.timeline, "SN": stream.name}
        self.lines: list = []
        self.line_task: dict = {}
        self.here: set = set()
        self.inputs_map = None          # inside a segment's body: input source -> its index in ``I``
        self.moduli = sorted({t.k for t in stream.tasks} | {runtime.feed.k} |
                             {runtime.tasks[src[1]].k for t in stream.tasks for src in t.spec.inputs if src[0] == "task"})

    def slot(self, k: int) -> str:
        return "0" if k == 1 else f"s{k}"

    def expr(self, src) -> str:
        if src[0] == "const":
            return _constant(src[1], self.ns)
        if self.inputs_map is not None and not (src[0] == "task" and src[1] in self.here):
            return f"I[{self.inputs_map[src]}]"
        if src[0] == "feed":
            return f"F.regs[{self.slot(self.rt.feed.k)}][{self.rt.feed_index[src[1]]}]"
        tid, out = src[1], src[2]
        if tid in self.here:
            return f"o{tid}[{out}]"
        self.ns[f"T{tid}"] = self.rt.tasks[tid]
        return f"T{tid}.regs[{self.slot(self.rt.tasks[tid].k)}][{out}]"

    def call(self, t, recycle: bool = True) -> str:
        spec, ns, tid = t.spec, self.ns, t.spec.id
        if spec.node is None:
            acc, x = (self.expr(src) for src in spec.inputs)
            return f"(_fold({acc}, {x}, {spec.fold[0]}, {spec.fold[1]}),)"
        n = spec.node
        by_vid = {vid: self.expr(src) for vid, src in zip(n.inputs, spec.inputs)}

        def one(v):
            if isinstance(v, Ref):
                return by_vid[v.vid]
            if isinstance(v, StorageRef):
                return f"{by_vid[v.vid]}.untyped_storage()"
            if isinstance(v, (list, tuple)) and any(isinstance(x, Ref) for x in v):
                inner = ", ".join(one(x) for x in v)
                return f"[{inner}]" if isinstance(v, list) else f"({inner},)"
            return _constant(v, ns)
        if n.kind == "collective":
            leaves, tree = n.args
            ns[f"SPEC{tid}"], ns[f"COLL{tid}"] = tree, getattr(self.rt.world, n.target)
            return f"tuple(_flat(COLL{tid}(*_unflat([{', '.join(one(x) for x in leaves)}], SPEC{tid})))[0])"
        args, kwargs = n.args
        op = n.target._op if isinstance(n.target, torch._ops.OpOverload) else n.target   # or a mapped call's task
        ns[f"OP{tid}"] = (recycle and recycled(n.target, t.k)) or _binding(n) or op
        call = ", ".join([one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()])
        if n.out_slots is None:
            return f"(OP{tid}({call}),)"
        ns[f"_pick{tid}"] = _picker(n.out_slots)
        return f"_pick{tid}(OP{tid}({call}))"

    def releases(self) -> dict:
        """consumer id -> the tasks of this stream whose register it reads last: once it has run, the
        slot holds nothing anyone needs, so it is emptied then (the memory goes back as eagerly as
        in an eager run), not when the next iteration overwrites it. Registers read from other
        streams are emptied by their last reader (runtime.Countdown); here only the local that holds
        them goes, after the last reader on this stream. Those of CUDA streams are kept until overwritten."""
        order = {t.spec.id: i for i, t in enumerate(self.stream.tasks)}
        release: dict = {}
        for t in self.stream.tasks:
            if t.cuda_consumers:
                continue
            mine = [c.spec.id for c in t.consumers if c.stream is t.stream]
            last = max(mine, key=order.__getitem__, default=t.spec.id)
            release.setdefault(last, []).append(t.spec.id)
        return release

    def emit(self, line: str, task=None) -> None:
        self.lines.append("    " + line)
        if task is not None:
            self.line_task[len(self.lines)] = task

    def _stores(self, t, part_of: dict) -> bool:
        """Whether ``t``'s output must sit in its register: read by a task of another stream or of
        another part of this one, measured, published to a CUDA stream, or fed back across
        iterations. A register read only by later tasks of its own part lives in a local."""
        return bool(self.rt.measure or t.waits_credit or t.cuda_consumers or
                    any(c.stream is not t.stream or part_of[c.spec.id] != part_of[t.spec.id] for c in t.consumers))

    def build(self):
        """One function per run of PART tasks (a function of tens of thousands of lines runs slower
        than the same lines in functions of a few hundred), and ``iteration`` calling them in order."""
        tasks = self.stream.tasks
        runs = {seg.tasks[0]: seg for seg in self.rt.graphs.segments.get(self.stream.name, ())}
        release = self.releases()
        part_of = {t.spec.id: i // PART for i, t in enumerate(tasks)}
        self.stored = [t for t in tasks if self._stores(t, part_of)]
        stored = {t.spec.id for t in self.stored}
        parts = []
        for first in range(0, len(tasks), PART):
            part = tasks[first:first + PART]
            name = f"part{first // PART}"
            parts.append(name)
            self.lines.append(f"def {name}(it, RESULTS):")
            if any(t.sinks for t in part):
                self.emit("ROW = RESULTS[it]")
            for k in self.moduli:
                if k > 1:
                    self.emit(f"s{k} = it % {k}")
            self.here = set()
            i = 0
            while i < len(part):
                seg = runs.get(part[i].spec.id)
                if seg is not None:
                    self._segment(seg, release, stored, part_of)
                    i += len(seg.tasks)
                else:
                    self._task(part[i], release, stored, part_of)
                    i += 1
            self.emit("pass")
        self.lines.append("def iteration(it, RESULTS):")
        self.lines.extend(f"    {name}(it, RESULTS)" for name in parts)
        self.lines.append("    pass")
        exec(compile("\n".join(self.lines) + "\n", f"<stream {self.stream.name}>", "exec"), self.ns)
        return self.ns["iteration"]

    def _segment(self, seg, release: dict, stored: set, part_of: dict) -> None:
        """A captured segment: its tasks' waits, its graph's call, then each task's bookkeeping."""
        rt, first, plan = self.rt, seg.tasks[0], self.rt.graphs
        tasks = [rt.tasks[i] for i in seg.tasks]
        inputs = [src for src in seg.inputs if src[0] != "const"]
        k = plan.slots[first]
        self.ns[f"G{first}"] = SegmentGraph(f"{self.stream.name}: {tasks[0].name} .. {tasks[-1].name}",
                                           self._body(seg, inputs), k,
                                           [src[0] == "task" and plan.slots.get(src[1]) == k for src in inputs],
                                           plan.backend, plan.pool(self.stream.name))
        for t in tasks:
            self._waits(t)
        if rt.timeline_on:
            self.emit("t0 = CLOCK()")
        self.emit(f"g{first} = G{first}(it, [{', '.join(self.expr(src) for src in inputs)}])", tasks[0])
        if rt.timeline_on:
            self.emit(f"TL.append((SN, {'graph ' + tasks[0].name!r}, it, t0, CLOCK()))")
        where = {out: j for j, out in enumerate(seg.outputs)}
        for t in tasks:
            picked = [f"g{first}[{where[t.spec.id, o]}]" if (t.spec.id, o) in where else "None"
                      for o in range(_outputs(t.spec))]
            self._task(t, release, stored, part_of, value=f"({', '.join(picked)},)")

    def _body(self, seg, inputs: list):
        """``body(I)``: the segment's op calls on its inputs ``I`` (constants in place), its outputs."""
        here, first = self.here, seg.tasks[0]
        self.inputs_map, self.here = {src: j for j, src in enumerate(inputs)}, set()
        lines = [f"def BODY{first}(I):"]
        for tid in seg.tasks:
            lines.append(f"    o{tid} = {self.call(self.rt.tasks[tid], recycle=False)}")
            self.here.add(tid)
        lines.append(f"    return ({''.join(f'o{tid}[{o}], ' for tid, o in seg.outputs)})")
        self.inputs_map, self.here = None, here
        exec(compile("\n".join(lines) + "\n", f"<segment {self.stream.name} {first}>", "exec"), self.ns)
        return self.ns[f"BODY{first}"]

    def _waits(self, t) -> None:
        tid = t.spec.id
        if t.waits_in or t.waits_credit:
            self.ns[f"W{tid}"] = self.rt._waiter(self.stream, t)
            self.emit(f"W{tid}(it)", t)
        if t.cuda_waits or t.cuda_consumers:
            self.ns[f"CW{tid}"] = self.rt._cuda_waiter(t)
            self.emit(f"CW{tid}(it)", t)

    def _task(self, t, release: dict, stored: set, part_of: dict, value: str = "") -> None:
        """One task's lines; ``value``: its outputs as a captured segment gave them (its waits and op
        call are the segment's)."""
        rt, tid = self.rt, t.spec.id
        self.ns[f"T{tid}"] = t
        self.emit(f"# {t.name}")
        if not value:
            self._waits(t)
        timed = rt.timeline_on and not value
        if timed:
            self.emit("t0 = CLOCK()")
        self.emit(f"o{tid} = {value or self.call(t)}", t)
        self.here.add(tid)
        if tid in stored:
            self.emit(f"T{tid}.regs[{self.slot(t.k)}] = o{tid}")
            if t.countdown is not None:
                self.ns[f"CD{tid}"] = t.countdown
                self.emit(f"CD{tid}.arm({self.slot(t.k)})")
        for p in dict.fromkeys(src[1] for src in t.spec.inputs if src[0] == "task"):
            producer = rt.tasks[p]
            if producer.countdown is not None:
                self.ns[f"CD{p}"] = producer.countdown
                self.emit(f"CD{p}.read({self.slot(producer.k)})")
        for j, slot in t.sinks:
            self.emit(f"ROW[{slot}] = o{tid}[{j}]")
        if t.events is not None:
            self.ns[f"PUB{tid}"] = rt._cuda_publisher(t)
            self.emit(f"PUB{tid}(it)", t)
        if timed:
            self.emit(f"TL.append((SN, {t.name!r}, it, t0, CLOCK()))")
        if t in rt.done_read:
            self.emit(f"T{tid}.done = it + 1")
        for p in release.get(tid, ()):
            local = f"o{p} = None" if part_of[p] == part_of[tid] else ""
            register = f"T{p}.regs[{self.slot(rt.tasks[p].k)}] = " \
                if p in stored and rt.tasks[p].countdown is None else ""
            if local or register:
                self.emit(register + (local or "None"))
        for i, s in enumerate(t.notify):
            self.ns[f"N{tid}_{i}"] = s.cond
            self.emit(f"with N{tid}_{i}: N{tid}_{i}.notify_all()")
        if rt.measure:
            self.ns["MEASURE"] = rt._sample_memory
            self.emit("MEASURE()")


def _binding(n):
    """The op's Python binding where it provably dispatches the node's overload (bindings.py)."""
    if any(m is None for m in n.metas.values()):
        return None

    def meta(v):
        if isinstance(v, Ref):
            shape, strides, _, dtype = n.metas[v.vid]
            return torch.empty_strided(shape, strides, dtype=dtype, device="meta")
        if isinstance(v, StorageRef):
            raise LookupError
        if isinstance(v, (list, tuple)):
            return type(v)(meta(x) for x in v)
        return v
    args, kwargs = n.args
    try:
        meta_args, meta_kwargs = tuple(meta(a) for a in args), {k: meta(v) for k, v in kwargs.items()}
    except LookupError:                 # a storage argument (set_): the op's own call
        return None
    return fast_call(n.target, meta_args, meta_kwargs)


def _outputs(spec) -> int:
    """How many values a task's call gives (its tuple's length)."""
    if spec.node is None:
        return 1
    return 1 if spec.node.out_slots is None else len(spec.node.out_slots)


def _picker(slots: list):
    def pick(o):
        return tuple(o[j] for j in slots)
    return pick
