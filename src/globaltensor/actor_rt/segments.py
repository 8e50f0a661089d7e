"""The segment pass: which runs of a compiled program's compute tasks a CUDA graph could replay.

Pure: a lowered Program in, segments out (nothing runs). Each rank's compute stream is cut into
maximal runs of tasks that need the host at neither end:

- a task that reads a value another stream made starts a new segment (the stream waits on that
  stream's event first), and so does one ordered after another stream's task;
- a task whose value another stream reads ends its segment (the event is recorded after it);
- a task that cannot be captured -- on a CPU device, a collective (a pipeline stage's inline
  send), or host code (``gt.local_map``'s mapped call, which keeps an autograd graph per call; an
  optimizer's update on pieces, nn/optim_pieces.py, which reads its settings at each run) -- is a
  segment of its own, uncapturable, with the reason;
- with ``cut_every=n``, a segment also ends every ``n`` tasks of its stream (where the stream's
  generated code starts a new function, stream_code.py).

A segment's ``inputs`` are the values it reads from outside it (other tasks' outputs, fed
arguments, constants: what a capture would copy into static buffers); its ``outputs`` the values
of its tasks that anything outside it reads (other segments, the call's results, state rebound
after the call). Collectives and copies stay tasks of their own streams between segments.
``g.plan.segments`` lists them; ``gt.compile(fn, cuda_graphs=True)`` captures the capturable ones
(cuda_graphs.py). The device type taken as capturable is ``cuda`` (a stand-in graph in the tests
takes ``cpu``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Set, Tuple

import torch

from .program import Program


@dataclass
class Segment:
    stream: str
    rank: int
    tasks: List[int] = field(default_factory=list)          # task ids, in the stream's order
    inputs: List[tuple] = field(default_factory=list)       # ("task", id, out) | ("feed", key) | ("const", ...)
    outputs: List[Tuple[int, int]] = field(default_factory=list)   # (task id, out) read outside
    reason: str = ""                                         # why it cannot be captured ("": it can)

    @property
    def capturable(self) -> bool:
        return not self.reason

    def __repr__(self) -> str:
        what = "capturable" if self.capturable else f"not capturable: {self.reason}"
        return (f"Segment({self.stream}, tasks {self.tasks}, {len(self.inputs)} inputs, "
                f"{len(self.outputs)} outputs, {what})")


def _uncapturable(task, device_type: str) -> str:
    if task.node is not None and task.node.kind == "collective":
        return f"a collective ({task.name}) runs on the compute stream"
    target = getattr(task.node, "target", None)
    if target is not None and not isinstance(target, (torch._ops.OpOverload, str)):
        return f"host code ({task.name})"
    if task.device is None or getattr(task.device, "type", "cpu") != device_type:
        return f"CPU tensors ({task.name})" if device_type == "cuda" else f"not on {device_type} ({task.name})"
    return ""


def compute_stream(name: str) -> bool:
    """Whether stream ``name`` is a compute stream: ``...:compute``, or a device's one shared stream."""
    return name.endswith(":compute") or ":" not in name


def _readers(program: Program) -> Dict[Tuple[int, int], Set[int]]:
    """(task id, output) -> the tasks reading it."""
    out: Dict[Tuple[int, int], Set[int]] = {}
    for t in program.tasks:
        for x in t.inputs:
            if x[0] == "task":
                out.setdefault((x[1], x[2]), set()).add(t.id)
    return out


def _program_reads(program: Program) -> Set[Tuple[int, int]]:
    """The task outputs the call hands back or rebinds as state."""
    refs = [ref for _, refs in program.outputs for ref in refs.values()]
    refs += [ref for _, _, ref in program.rebinds]
    refs += [ref for _, _, refs in program.grad_rebinds for ref in refs.values()]
    return {(r[1], r[2]) for r in refs if isinstance(r, tuple) and r and r[0] == "task"}


def plan_segments(program: Program, device_type: str = "cuda", cut_every: int = 0) -> List[Segment]:
    """The segments of every compute stream of ``program`` (see the module's docstring)."""
    tasks = program.tasks
    stream_of = {t.id: t.stream for t in tasks}
    readers = _readers(program)
    returned = _program_reads(program)
    n_out = {t.id: len(t.node.outs) if t.node is not None else 1 for t in tasks}
    for tid, o in list(readers) + list(returned):
        n_out[tid] = max(n_out[tid], o + 1)
    segments: List[Segment] = []
    for stream, ids in program.order.items():
        if not compute_stream(stream):
            continue
        current = None
        for position, tid in enumerate(ids):
            t = tasks[tid]
            reason = _uncapturable(t, device_type)
            waits = any(x[0] == "task" and stream_of[x[1]] != stream for x in t.inputs) or \
                any(stream_of[d] != stream for d, _ in t.deps)
            cut = cut_every and position % cut_every == 0
            if current is None or reason or current.reason or waits or cut:
                current = Segment(stream, t.rank, reason=reason)
                segments.append(current)
            current.tasks.append(tid)
            publishes = any(stream_of[r] != stream for o in range(n_out[tid]) for r in readers.get((tid, o), ()))
            if publishes or reason:
                current = None
    for seg in segments:
        members, seen = set(seg.tasks), set()
        for tid in seg.tasks:
            for x in tasks[tid].inputs:
                key = (x[0], id(x[1])) if x[0] == "const" else x      # a constant: by identity (a tensor)
                if (x[0] != "task" or x[1] not in members) and key not in seen:
                    seen.add(key)
                    seg.inputs.append(x)
            for o in range(n_out[tid]):
                if (tid, o) in returned or readers.get((tid, o), set()) - members:
                    seg.outputs.append((tid, o))
    return segments

