"""Lowering: a captured graph -> the physical task graph of the ranks this process holds.

Every recorded piece op and collective becomes a task bound to a stream: ``r<rank>:compute``,
``r<rank>:copy`` (moves between devices) or ``r<rank>:collective`` (a collective of a simulated
world runs on its lowest member's). One exception, in a process world on CPU: a point-to-point
exchange in which this rank only sends (a pipeline stage handing its activation on) runs on the
compute stream, right after the task that made what it sends (:func:`_inline_sends`). Tasks nothing needs are pruned (collectives and writes into
state are always needed). One *reference order* -- the capture order, or with micro-batches
GPipe's: each forward / backward segment for micro-batch 0, 1, ..., in turn -- is a valid
sequential execution; each stream's static order is that order restricted to the stream, so the
collectives of every group come in the same order on every rank, and every wait points at
something earlier in it, which is why the graph cannot deadlock.

Edges: data (a task reads another's output register), ordering within a call (read-after-write,
write-after-read, write-after-write on one storage: in-place ops, views) and, for state written
in place, ordering across calls (the next call's first reader of a parameter waits for this
call's optimizer update): *delayed* edges.

With ``micro_batches=m`` the ops that depend on a batch argument (everything up to the end of the
last backward, and what after it derives from the forward) run once per micro-batch; the rest
(the optimizer step, ``zero_grad``) once per call. A value crossing from the first kind to the
second (a gradient, the returned loss) is the mean over the micro-batches: a chain of *fold*
tasks, each adding one micro-batch's value as soon as it is made.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple, Union

from torch.utils._pytree import tree_unflatten

from .capture import EFFECTS
from .fuse_views import fuse_views, without_dead_views
from .graph import Captured, Node
from .order import communication_first
from .pipeline_order import PipelineSchedule, unit_ends
from .program import CompileError, Program, TaskSpec


def _live(cap: Captured) -> set:
    """Nodes needed for the outputs, the state the call leaves behind, its writes and collectives."""
    nodes, values = cap.nodes, cap.values
    external = {v.storage for v in values.values() if v.kind in ("state", "arg") and v.storage is not None}
    writers: Dict[tuple, List[int]] = {}
    for n in nodes:
        for s in n.writes:
            writers.setdefault(s, []).append(n.index)
    wanted = [vid for o in cap.outputs for vid in o.refs.values()]
    wanted += [vid for _, _, vid in cap.rebinds] + [v for _, _, refs in cap.grad_rebinds for v in refs.values()]
    work = [values[v].node for v in wanted if values[v].kind == "node"]
    for v in wanted:                            # an output filled in after it was made (empty, then copy_)
        work.extend(writers.get(values[v].storage, ()))
    work += [n.index for n in nodes if n.kind == "collective" or set(n.writes) & external or n.target in EFFECTS]
    live = set()
    while work:
        i = work.pop()
        if i in live:
            continue
        live.add(i)
        n = nodes[i]
        for v in n.inputs:
            if values[v].kind == "node":
                work.append(values[v].node)
        for s in n.reads:                       # whoever wrote what it reads, before it
            work.extend(w for w in writers.get(s, ()) if w < i)
        for v in n.outs:                        # and whoever fills its outputs in later
            work.extend(w for w in writers.get(values[v].storage, ()) if w > i)
    return live


def _last_backward(cap: Captured, what: str) -> int:
    last = max((n.segment for n in cap.nodes if n.backward), default=None)
    if last is None:
        raise CompileError(f"gt.compile({what}): the function runs no backward; micro-batches and pipeline "
                           f"schedules split a training step (forward, backward, update)")
    return last


def _per_micro_batch(cap: Captured, live: set, m: int, scheduled: bool) -> Dict[int, bool]:
    """Which live nodes run once per micro-batch: every one for a single micro-batch, unless a pipeline
    schedule orders it (its ops after the backward then run once, after every unit, as for more)."""
    if m == 1 and not scheduled:
        return {i: True for i in live}
    nodes, values = cap.nodes, cap.values
    last_backward = _last_backward(cap, "micro_batches=m")
    per_mb, forward_derived = {}, {}
    for i in sorted(live):
        n = nodes[i]
        if n.segment <= last_backward:
            per_mb[i], forward_derived[i] = True, not n.backward
            continue
        derived = any(values[v].kind == "arg" or (values[v].kind == "node" and forward_derived.get(values[v].node))
                      for v in n.inputs)
        per_mb[i] = derived and n.kind != "collective"   # a collective after the backward: once, on every rank
        forward_derived[i] = per_mb[i]
    return per_mb


class _Builder:
    def __init__(self, cap: Captured, m: int, host_rank: int, collective_rank: Optional[int]):
        self.cap, self.m = cap, m
        self.schedule: Optional[PipelineSchedule] = None
        self.host_rank, self.collective_rank = host_rank, collective_rank
        self.tasks: List[TaskSpec] = []
        self.instance: Dict[Tuple[int, Optional[int]], int] = {}
        self.acc: Dict[int, int] = {}
        self.late: set = set()               # once-per-call tasks after the micro-batches (see build)
        self.feeds: Dict[tuple, tuple] = {}
        self.keys: List[tuple] = []          # sort key of every task, for the reference order

    def rank_of(self, n: Node) -> int:
        if n.kind == "collective":
            if self.collective_rank is not None:
                return self.collective_rank
            return n.ranks[0] if n.ranks else self.host_rank
        return n.rank if n.rank is not None else self.host_rank

    def resolve(self, vid: int, mb: Optional[int]):
        v = self.cap.values[vid]
        if v.kind == "state":
            return ("const", v.tensor)
        if v.kind == "arg":
            key = ("arg", v.arg[0], v.arg[1], mb or 0)
            self.feeds[key] = ("arg", v.arg[0], v.arg[1], mb or 0)
            return ("feed", key)
        if v.kind == "keys":
            key = ("keys", vid, mb or 0)
            self.feeds[key] = ("keys",) + v.keys + (mb or 0,)
            return ("feed", key)
        if v.kind == "number":                   # one value for every micro-batch
            key = ("number",) + v.number
            self.feeds[key] = key
            return ("feed", key)
        producer = v.node
        if self.per_mb[producer]:
            if mb is None and self.m > 1:
                return ("task", self.accumulator(vid), 0)
            if mb is None:
                return ("task", self.instance[(producer, 0)], v.out)
            return ("task", self.instance[(producer, mb)], v.out)
        return ("task", self.instance[(producer, None)], v.out)

    def accumulator(self, vid: int) -> int:
        """The task giving the mean over the micro-batches of a per-micro-batch value: a chain of
        folds, fold ``j`` adding micro-batch ``j``'s value as soon as it exists (the last one also
        divides), so each micro-batch's value is let go early and no sum waits for the end."""
        if vid in self.acc:
            return self.acc[vid]
        v = self.cap.values[vid]
        n = self.cap.nodes[v.node]
        rank = self.rank_of(n) if n.kind == "op" else (v.rank if v.rank is not None else self.host_rank)
        previous = ("task", self.instance[(v.node, 0)], v.out)
        for j in range(1, self.m):
            t = TaskSpec(len(self.tasks), f"fold{j}/{self.m}({n.name}.{v.out})", None, None, rank,
                         f"r{rank}:compute", [previous, ("task", self.instance[(v.node, j)], v.out)],
                         nbytes=v.nbytes, device=n.device, fold=(j, self.m),
                         unit=self.tasks[self.instance[(v.node, j)]].unit)
            self.add(t, self.schedule.key(v.node, j, 0.5) if self.schedule else (n.segment, j, n.index + 0.5))
            self.late.add(t.id)
            previous = ("task", t.id, 0)
        self.acc[vid] = previous[1]
        return previous[1]

    def add(self, t: TaskSpec, key: tuple) -> None:
        self.tasks.append(t)
        self.keys.append(key)

    def build(self, live: set, schedule: str, exchange: Optional[Callable] = None) -> None:
        cap, m = self.cap, self.m
        self.per_mb = _per_micro_batch(cap, live, m, schedule != "gpipe")
        if schedule != "gpipe":
            self.schedule = PipelineSchedule(schedule, cap, [i for i in sorted(live) if self.per_mb[i]], m,
                                             _last_backward(cap, f"schedule={schedule!r}"), self.rank_of, exchange,
                                             self.collective_rank)
        for i in sorted(live):
            n = cap.nodes[i]
            rank = self.rank_of(n)
            for mb in (range(m) if self.per_mb[i] else [None]):
                inputs = [self.resolve(v, mb) for v in n.inputs]
                # a once-per-call task after the micro-batches: one reading a mean over them, and every
                # collective (whose place must not depend on what this process's pieces read: each
                # process issues its collectives in capture order, the others' sends and receives too)
                late = mb is None and (n.kind == "collective" or any(
                    x[0] == "task" and (self.tasks[x[1]].mb is not None or x[1] in self.late) for x in inputs))
                name = n.name + (f"#mb{mb}" if m > 1 and mb is not None else "")
                unit = self.schedule.unit(i, mb) if self.schedule and mb is not None else None
                if unit is not None:
                    name += f" [{unit[0]}{unit[1]}]"
                t = TaskSpec(len(self.tasks), name, n, mb, rank, f"r{rank}:{n.stream}", inputs,
                             nbytes=sum(cap.values[o].nbytes for o in n.outs), device=n.device, unit=unit)
                self.instance[(i, mb)] = t.id
                if late:
                    self.late.add(t.id)
                if unit is not None:
                    self.schedule.unit_tasks.setdefault(unit, []).append(t.id)
                    key = self.schedule.key(i, mb)
                elif self.schedule is not None:          # once per call: after every unit
                    key = (1, n.segment, m - 1 if late else 0, i)
                else:
                    key = (n.segment, mb if mb is not None else (m - 1 if late else 0), i)
                self.add(t, key)


def _assign_ranks(cap: Captured, live: set, host_rank: int) -> None:
    """Ops made on no rank's piece (a factory inside a boxing) run on the rank of what uses them."""
    values, nodes = cap.values, cap.nodes
    users: Dict[int, List[int]] = {}
    for j in live:
        for v in nodes[j].inputs:
            if values[v].kind == "node":
                users.setdefault(values[v].node, []).append(j)
    for i in sorted(live, reverse=True):
        n = nodes[i]
        if n.kind == "op" and n.rank is None:
            n.rank = next((nodes[j].rank for j in sorted(users.get(i, ())) if nodes[j].kind == "op"
                           and nodes[j].rank is not None), None)
    for i in sorted(live):                      # else the rank of what it reads, else the host's
        n = nodes[i]
        if n.kind == "op" and n.rank is None:
            ranks = [values[v].rank if values[v].kind != "node" else nodes[values[v].node].rank for v in n.inputs]
            n.rank = next((r for r in ranks if r is not None), host_rank)


def _ordering(tasks: List[TaskSpec], order: List[int], external: set, creator: dict) -> None:
    """Read/write hazards on storages, within a call and (state written in place) across calls."""
    last_write: Dict[tuple, int] = {}
    readers: Dict[tuple, List[int]] = {}
    accesses: Dict[tuple, List[Tuple[int, bool]]] = {}
    for tid in order:
        t = tasks[tid]
        if t.node is None:
            continue
        n = t.node

        def key(s):
            if s in external:
                return s
            c = creator.get(s)
            if c is None:
                return None
            if t.mb is None and c[1]:            # a once task touching a per-micro-batch storage: via its mean
                return None
            return (s, t.mb if c[1] else None)
        for s in set(n.reads) | set(n.writes):
            k = key(s)
            if k is None:
                continue
            write = s in n.writes
            if k in last_write:
                t.deps.append((last_write[k], 0))
            if write:
                t.deps.extend((r, 0) for r in readers.get(k, ()))
                last_write[k], readers[k] = tid, []
            else:
                readers.setdefault(k, []).append(tid)
            if s in external:
                accesses.setdefault(k, []).append((tid, write))
    for k, acc in accesses.items():
        writes = [i for i, (_, w) in enumerate(acc) if w]
        if not writes:
            continue
        first, last = writes[0], writes[-1]
        for i in range(first + 1):
            tasks[acc[i][0]].deps.append((acc[last][0], 1))
        for i in range(last + 1, len(acc)):
            tasks[acc[first][0]].deps.append((acc[i][0], 1))


def _inline_sends(tasks: List[TaskSpec], rank: int) -> List[int]:
    """The gloo ``send_recv`` tasks of ``rank`` to run on its compute stream: those in which it
    only sends, unless an exchange on the collective stream also sends to one of their peers.

    The receiver posts its receives ahead on its collective stream, as far as its registers
    allow, so such a send finds its receive posted and writes the message out at once; it waits
    only for a receiver that many micro-batches behind. On the collective stream every message
    costs a hand-off instead: the collective thread wakes, and its Python (``send_recv``'s) holds
    the GIL and a core while the compute thread waits at its next op -- on the 2-stage forward
    pipeline of benchmarks/actor_runtime.py, 0.2-0.6 ms per micro-batch of about 6, and the
    thread's 0.3-0.4 ms of CPU on cores the stages' compute already fills. Point-to-point
    messages match by peer and tag in the order each side issues them; the sends to a peer stay
    on one stream in the reference order (hence the exception for peers an exchange also sends
    to), and deadlock freedom holds as for any stream assignment.
    """
    def parts(t: TaskSpec):
        n = t.node
        if n is None or n.kind != "collective" or n.target != "send_recv":
            return None
        transfers, _, _, device_type = tree_unflatten(*n.args)
        sends = {x.dst for x in transfers if x.src == rank and x.dst != rank}
        receives = any(x.dst == rank and x.src != rank for x in transfers)
        return device_type, sends, receives
    p2p = {t.id: x for t in tasks if t.rank == rank for x in [parts(t)] if x is not None}
    shared = set().union(*[sends for _, sends, receives in p2p.values() if receives] or [set()])
    return [tid for tid, (device_type, sends, receives) in p2p.items()
            if device_type == "cpu" and sends and not receives and not sends & shared]


def _device_stream(t: TaskSpec, merged: bool) -> str:
    """The stream of ``t`` on its device: ``cpu`` for every CPU task when ``merged``, else
    ``<device>:<kind>`` (``cpu:compute``, ``cuda0:collective``)."""
    cpu = t.device is None or t.device.type == "cpu"
    if cpu and merged:
        return "cpu"
    device = "cpu" if cpu else f"{t.device.type}{t.device.index or 0}"
    return f"{device}:{t.stream.split(':')[1]}"


def lower(cap: Captured, *, micro_batches: int = 1, registers: Union[int, Callable] = 2,
          collective_rank: Optional[int] = None, streams: Union[None, str, Callable] = None,
          schedule: str = "gpipe", exchange: Optional[Callable] = None) -> Program:
    """The task graph of ``cap`` for the ranks this process holds.

    ``schedule``: the order of the micro-batches' forwards and backwards over the pipeline's stages
    (globaltensor/schedules.py); other than ``"gpipe"``, each stage's bound on the micro-batches it holds is
    enforced by dependencies, whatever the streams. ``exchange``: in a process world, the world's
    all-gather of an object, by which the processes agree on the pipeline's stages.

    ``streams`` chooses the stream of each task:

    - None: in a process world (``collective_rank`` given), each rank's own compute / copy /
      collective streams (``r<rank>:compute``; a CPU process world's sends, see
      ``_inline_sends``, on compute); in a simulated world, ``"shared"``;
    - ``"shared"``: the ranks that share a physical device share its streams; on CPU that is one
      stream for every task (``cpu``) -- Python threads on one CPU only take turns at the GIL (two
      threads running small ops took 3.5x the time of one), so a simulated CPU world runs its whole
      graph on the caller's thread, with no hand-off --, on a GPU its compute / copy / collective
      streams (``cuda0:compute``), which overlap on the device;
    - ``"device"``: per device, its compute / copy / collective streams, on CPU too (``cpu:compute``);
    - ``"rank"``: each rank its own streams, as in a process world (``r<rank>:compute``);
    - a function of a task: the name it returns (a task of a process world stays on its rank:
      ``r<rank>:<name>``).

    Any assignment is deadlock-free: every stream follows the one reference order."""
    live = _live(cap)
    _assign_ranks(cap, live, cap.held_ranks[0])
    b = _Builder(cap, micro_batches, cap.held_ranks[0], collective_rank)
    b.build(live, schedule, exchange)
    outputs = []
    for o in cap.outputs:
        refs = {r: b.resolve(v, None) for r, v in o.refs.items()}
        outputs.append((o, refs))
    rebinds = [(w, r, b.resolve(v, None)) for w, r, v in cap.rebinds]
    grad_rebinds = [(i, layout, {r: b.resolve(v, None) for r, v in refs.items()})
                    for i, layout, refs in cap.grad_rebinds]
    tasks = b.tasks
    order = sorted(range(len(tasks)), key=lambda t: b.keys[t])
    position = {tid: p for p, tid in enumerate(order)}
    for t in tasks:
        for x in t.inputs:
            if x[0] == "task" and position[x[1]] >= position[t.id]:
                raise CompileError(f"gt.compile(schedule={schedule!r}): task {t.name} needs {tasks[x[1]].name}, which "
                                   f"the schedule puts after it (a per-micro-batch op reads the mean over "
                                   f"micro-batches, or a value of a later unit)")
    external = {v.storage for v in cap.values.values() if v.kind in ("state", "arg") and v.storage is not None}
    creator = {}
    per_mb = b.per_mb
    for v in cap.values.values():
        if v.kind == "node" and v.storage is not None and v.storage not in creator and v.storage not in external:
            creator[v.storage] = (v.node, per_mb.get(v.node, False) and micro_batches > 1)
    _ordering(tasks, order, external, creator)
    if b.schedule is not None:
        b.schedule.credits(tasks, position)
    fuse_views(tasks, cap.values)
    needed = {x[1] for _, refs in outputs for x in refs.values() if x[0] == "task"} | \
        {x[1] for _, _, x in rebinds if x[0] == "task"} | \
        {x[1] for _, _, refs in grad_rebinds for x in refs.values() if x[0] == "task"}
    tasks, order, remap = without_dead_views(tasks, order, needed)
    outputs = [(o, {r: remap(x) for r, x in refs.items()}) for o, refs in outputs]
    rebinds = [(w, r, remap(x)) for w, r, x in rebinds]
    grad_rebinds = [(i, layout, {r: remap(x) for r, x in refs.items()}) for i, layout, refs in grad_rebinds]
    for t in tasks:
        k = registers(t) if callable(registers) else registers
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"gt.compile(registers=): expected a register count >= 1 for task {t.name}, got {k!r}")
        t.registers = k
        if streams in ("device", "shared") or (streams is None and collective_rank is None):
            t.stream = _device_stream(t, merged=streams != "device")
        elif streams not in (None, "rank"):
            name = streams(t)
            if not isinstance(name, str) or not name or \
                    (collective_rank is not None and not name.startswith(f"r{t.rank}:")):
                raise ValueError(f"gt.compile(streams=): expected a stream name 'r{t.rank}:<name>' for task {t.name} "
                                 f"(in a process world a task stays on its rank), got {name!r}")
            t.stream = name
        t.deps = sorted(set(d for d in t.deps if d[0] != t.id or d[1] == 1))
    if streams is None and collective_rank is not None:
        for tid in _inline_sends(tasks, collective_rank):
            tasks[tid].stream = f"r{collective_rank}:compute"
    order = communication_first(tasks, order, unit_ends(tasks, order) if b.schedule is not None else None)
    streams: Dict[str, List[int]] = {}
    for tid in order:
        streams.setdefault(tasks[tid].stream, []).append(tid)
    return Program(tasks, streams, outputs, rebinds, grad_rebinds, sorted(b.feeds, key=repr), b.feeds,
                   micro_batches, schedule, b.schedule.describe() if b.schedule else "")
